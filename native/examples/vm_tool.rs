//! The native VM on files, outside Python: `bench` times it on a pickle, `fuzz` runs a
//! deterministic mutation fuzzer over seed pickles for a while (cargo-fuzz/libFuzzer cannot be
//! fetched offline). Every mutant must give a result or UNSUPPORTED, never a panic or a hang.
//!
//!     cargo run --release --offline --example vm_tool -- bench data.pkl table.txt
//!     cargo run --release --offline --example vm_tool -- fuzz table.txt SECONDS seed.pkl...
//!
//! `table.txt` is `ckptfix.pickling.reader.native_table()`.

use ckptfix_native::vm::{load, Budgets, Config};
use std::time::{Duration, Instant};

fn budgets(len: usize) -> Budgets {
    let len = len as u64;
    Budgets {
        max_objects: (1u64 << 27).min((1 << 16) + len),
        max_alloc: (8u64 << 30).min((64 << 20) + 32 * len),
        max_memo: (1u64 << 27).min((1 << 16) + len),
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: [u8; 24] = [
    0, 1, 0x7f, 0x80, 0xff, b'(', b')', b't', b'.', 0x95, b'h', b'q', b'j', b'r', b'R', b'Q', b'b',
    b'u', b's', b'e', b'0', b'2', 0x94, 0x85,
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], m: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(6) {
        let len = m.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                m[i] = rng.next() as u8;
            }
            1 if len > 0 => {
                let i = rng.below(len);
                m.remove(i);
            }
            2 => {
                let i = rng.below(len + 1);
                m.insert(i, INTERESTING[rng.below(INTERESTING.len())]);
            }
            3 if len > 1 => {
                // duplicate a slice somewhere (memo juggling, repeated structure)
                let a = rng.below(len);
                let b = (a + 1 + rng.below(64)).min(len);
                let chunk = m[a..b].to_vec();
                let at = rng.below(m.len() + 1);
                m.splice(at..at, chunk);
            }
            4 if len > 4 => {
                // a 4-byte length or index set to an edge value
                let i = rng.below(len - 4);
                let v: u32 = [0, 1, 0xff, 0x7fff_ffff, 0xffff_ffff, len as u32][rng.below(6)];
                m[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            5 => {
                // splice in a slice of another seed
                let s = &seeds[rng.below(seeds.len())];
                if !s.is_empty() {
                    let a = rng.below(s.len());
                    let b = (a + 1 + rng.below(128)).min(s.len());
                    let at = rng.below(len + 1);
                    m.splice(at..at, s[a..b].iter().copied());
                }
            }
            _ if len > 0 => {
                let i = rng.below(len);
                m.truncate(i);
            }
            _ => {}
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let table = |p: &str| Config::parse(&std::fs::read(p).expect("table")).expect("table parses");
    match args.get(1).map(String::as_str) {
        Some("bench") => {
            let data = std::fs::read(&args[2]).expect("pickle");
            let config = table(&args[3]);
            for _ in 0..5 {
                let t = Instant::now();
                let out = load(&data, 0, data.len(), &config, budgets(data.len()), true);
                println!(
                    "{:.3} s, {} bytes out",
                    t.elapsed().as_secs_f64(),
                    out.map_or(0, |o| o.len())
                );
            }
        }
        Some("fuzz") => {
            let config = table(&args[2]);
            let seconds: u64 = args[3].parse().expect("seconds");
            let seeds: Vec<Vec<u8>> = args[4..]
                .iter()
                .map(|p| std::fs::read(p).expect("seed"))
                .collect();
            let mut rng = Rng(0x2545_f491_4f6c_dd1d);
            let (start, mut runs, mut read, mut slowest) =
                (Instant::now(), 0u64, 0u64, Duration::ZERO);
            let mut m = Vec::new();
            while start.elapsed() < Duration::from_secs(seconds) {
                m.clear();
                m.extend_from_slice(&seeds[rng.below(seeds.len())]);
                mutate(&mut rng, &seeds, &mut m);
                let t = Instant::now();
                if load(&m, 0, m.len(), &config, budgets(m.len()), true).is_some() {
                    read += 1;
                }
                slowest = slowest.max(t.elapsed());
                runs += 1;
            }
            println!("{runs} mutants, {read} read natively, the rest UNSUPPORTED; no panic; slowest {slowest:?}");
        }
        _ => eprintln!("usage: vm_tool bench PICKLE TABLE | fuzz TABLE SECONDS SEED..."),
    }
}
