//! Unit tests of the native VM and its deterministic mutation fuzz loop.

use super::*;

fn config() -> Config {
    let table = b"2\ttorch._utils\t_rebuild_tensor_v2\n3\ttorch._utils\t_rebuild_tensor_v3\np\ttorch._utils\t_rebuild_parameter\no\tcollections\tOrderedDict\nrs\ttorch\tFloatStorage\nrs\ttorch.storage\tUntypedStorage\nrd\ttorch\tfloat32\nx\tbuiltins\tset\n";
    Config::parse(table).unwrap()
}

fn budgets(len: usize) -> Budgets {
    let len = len as u64;
    Budgets {
        max_objects: (1 << 16) + len,
        max_alloc: (64 << 20) + 32 * len,
        max_memo: (1 << 16) + len,
    }
}

fn run(data: &[u8]) -> Option<Vec<u8>> {
    load(data, 0, data.len(), &config(), budgets(data.len()), true)
}

#[test]
fn plain_values_are_read() {
    // {'a': [1, 2.5, None, True], 'b': b'xy'} at protocol 2
    let p = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01](K\x01G@\x04\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bC\x02xyu.";
    assert!(run(p).is_some());
}

#[test]
fn unknown_opcodes_globals_and_crossings_are_left_to_python() {
    assert!(run(b"\x80\x02cos\nsystem\n.").is_none());
    assert!(run(b"I1\n.").is_none());
    assert!(run(b"\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00J\x01\x00\x00\x00.").is_none()); // crosses
    assert!(run(b"\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00K\x01.").is_some()); // fits
    assert!(run(b"\x80\x02K\x01K\x02.").is_none()); // two items at STOP
}

#[test]
fn cycles_are_left_to_python() {
    // L = []; L.append(L)
    assert!(run(b"\x80\x02]q\x00h\x00a.").is_none());
    // a list holding the same list twice is fine (shared, not a cycle)
    assert!(run(b"\x80\x02](]q\x00h\x00e.").is_some());
}

#[test]
fn budgets_are_enforced() {
    let mut p = b"\x80\x02(".to_vec();
    p.extend(std::iter::repeat_n(b']', 100));
    p.extend_from_slice(b"l.");
    let tight = Budgets {
        max_objects: 50,
        max_alloc: 1 << 30,
        max_memo: 10,
    };
    assert!(load(&p, 0, p.len(), &config(), tight, true).is_none());
    assert!(run(&p).is_some());
}

/// A deterministic mutation fuzzer: every mutant must give a result or Unsup, never a panic,
/// and stay within bounded time (each run is linear in its input).
#[test]
fn mutation_fuzz_loop() {
    let seeds: Vec<Vec<u8>> = vec![
        b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01](K\x01G@\x04\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bC\x02xyu.".to_vec(),
        tensor_pickle(),
    ];
    let rounds: u64 = std::env::var("CKPTFIX_FUZZ_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut ok = 0u64;
    for _ in 0..rounds {
        let mut m = seeds[(next() % seeds.len() as u64) as usize].clone();
        for _ in 0..1 + next() % 4 {
            let len = m.len() as u64;
            match next() % 5 {
                0 if len > 0 => m[(next() % len) as usize] = next() as u8,
                1 if len > 0 => {
                    m.remove((next() % len) as usize);
                }
                2 => m.insert((next() % (len + 1)) as usize, next() as u8),
                3 if len > 1 => {
                    let a = (next() % len) as usize;
                    let b = a + (next() % (len - a as u64)) as usize;
                    let chunk = m[a..b].to_vec();
                    let at = (next() % (m.len() as u64 + 1)) as usize;
                    m.splice(at..at, chunk);
                }
                _ => {
                    let interesting = [0u8, 0x7f, 0x80, 0xff, b'(', b't', b'.', 0x95, b'h', b'q'];
                    if len > 0 {
                        m[(next() % len) as usize] = interesting[(next() % 10) as usize];
                    }
                }
            }
        }
        if run(&m).is_some() {
            ok += 1;
        }
    }
    assert!(
        rounds < 100 || ok > 0,
        "no mutant was read at all: the fuzzer explores nothing"
    );
}

/// `{'w': _rebuild_tensor_v2(('storage', FloatStorage, '0', 'cpu', 4), 0, (4,), (1,), False, OrderedDict())}`
pub(super) fn tensor_pickle() -> Vec<u8> {
    let mut p = b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01ctorch._utils\n_rebuild_tensor_v2\nq\x02((X\x07\x00\x00\x00storageq\x03ctorch\nFloatStorage\nq\x04X\x01\x00\x00\x000q\x05X\x03\x00\x00\x00cpuq\x06K\x04tq\x07QK\x00K\x04\x85q\x08K\x01\x85q\x09\x89ccollections\nOrderedDict\nq\x0a)Rq\x0btq\x0cRq\x0ds.".to_vec();
    p.shrink_to_fit();
    p
}

#[test]
fn a_tensor_is_read() {
    assert!(run(&tensor_pickle()).is_some());
}
