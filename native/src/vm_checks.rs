//! What the reader checks once a tree is read (`model/walk.py`'s `check_extents`), over the VM's
//! own columns instead of a Python walk over 200 000 records.
//!
//! `check_extents` does two things for a zip checkpoint: it walks the tree (the walk refuses
//! containers nested deeper than `MAX_NESTING`), and it checks every tensor's extent -- `(offset +
//! sum((n - 1) * s) + 1) * itemsize` bytes, or none for a tensor without elements, and fewer than
//! 2**63 bytes of elements -- against its storage's byte size (every storage also against its
//! record, which a zip storage passes by construction: its size was checked equal). Here:
//!
//! * [`needed`]: each tensor's extent in bytes, with checked arithmetic, or -1 where Python must
//!   decide (an element count past 2**63 bytes, an unknown element size, any overflow);
//! * [`nesting_bound`]: the longest path from the root, counting every level the walk counts (a
//!   tensor's hooks and metadata one level below it, its parameter state two, an OrderedDict's
//!   `_metadata` two), so no container the walk reaches lies deeper than it;
//! * [`ckptfix_vm_extents`]: the comparison, once Python knows each storage's byte size.
//!
//! Every tensor the VM built is checked, reachable from the root or not, so "all fine" here
//! implies "all fine" in `check_extents`; anything else (a failure, a -1, a bound over the limit)
//! makes Python run `check_extents` itself, whose message is then the reference's by construction.

use super::{Budgets, Node, Out, Tensor, Val, Vm, EMPTY_DICT, NO_DICT};

/// `(max_objects, max_alloc, max_memo)` from the three native-endian u64 Python passes.
pub(super) fn budgets(limits: &[u8]) -> Budgets {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&limits[8 * i..8 * i + 8]);
        u64::from_ne_bytes(b)
    };
    Budgets {
        max_objects: word(0),
        max_alloc: word(1),
        max_memo: word(2),
    }
}

/// The int items of a shape or stride the VM checked (ints >= 0).
fn ints<'v>(vm: &'v Vm, v: Val) -> impl Iterator<Item = i64> + 'v {
    vm.seq(v)
        .unwrap_or(&[])
        .iter()
        .map(|x| if let Val::Int(i) = x { *i } else { -1 })
}

/// A tensor's extent in bytes as `check_extents` computes it (0: no elements), or -1 where the
/// Python check must decide.
fn needed(vm: &Vm, t: &Tensor) -> i64 {
    let class = vm.pids.get(t.storage as usize).map(|p| p.0);
    let global = match t.v3 {
        None => class,
        Some(g) => Some(g),
    };
    let itemsize = match global.and_then(|g| vm.global_info.get(g as usize)) {
        Some(info) if info.itemsize > 0 => i128::from(info.itemsize),
        _ => return -1,
    };
    let mut numel: i128 = 1;
    for n in ints(vm, t.shape) {
        if n < 0 {
            return -1;
        }
        numel = match numel.checked_mul(i128::from(n)) {
            Some(v) if v < (1i128 << 64) => v,
            _ => return -1, // past 2**63 bytes for any element size: Python refuses it
        };
    }
    match numel.checked_mul(itemsize) {
        Some(v) if v < (1i128 << 63) => {}
        _ => return -1, // "more elements than torch can count": Python's message
    }
    if numel == 0 {
        return 0;
    }
    let mut last = i128::from(t.offset);
    for (n, s) in ints(vm, t.shape).zip(ints(vm, t.stride)) {
        if s < 0 {
            return -1;
        }
        // n >= 1 (numel > 0) and both below 2**63: the product fits in i128
        last = match last.checked_add(i128::from(n - 1) * i128::from(s)) {
            Some(v) if v < (1i128 << 100) => v,
            _ => return -1,
        };
    }
    match (last + 1).checked_mul(itemsize).map(i64::try_from) {
        Some(Ok(v)) => v,
        _ => -1, // larger than any storage: Python says how
    }
}

/// The node values `n` holds, each with the levels the walk puts between them (see the module
/// documentation).
fn children(vm: &Vm, n: u32, out: &mut Vec<(Val, u16)>) {
    match &vm.nodes[n as usize] {
        Node::Tuple(..) | Node::List(_) => {
            out.extend(vm.seq(Val::Node(n)).unwrap_or(&[]).iter().map(|&v| (v, 1)))
        }
        Node::Dict(v) => out.extend(v.iter().map(|&v| (v, 1))),
        Node::ODict(items, attr) => {
            out.extend(items.iter().map(|&v| (v, 1)));
            if *attr != NO_DICT && *attr != EMPTY_DICT {
                out.extend(vm.attrs.get(*attr as usize).map(|&v| (v, 2)));
            }
        }
        Node::Tensor(t) => {
            let t = &vm.tensors[*t as usize];
            out.push((t.hooks, 1));
            out.extend(t.metadata.map(|v| (v, 1)));
            if let Some((a, b, c)) = t.param.as_deref().copied() {
                out.push((a, 2));
                out.push((b, 2));
                out.extend(c.map(|v| (v, 2)));
            }
        }
        Node::Reduce { args, .. } => out.push((*args, 1)),
    }
}

const UNSEEN: u16 = u16::MAX;
const OPEN: u16 = u16::MAX - 1;
/// heights saturate here (far above `MAX_NESTING`; two bytes a node: the VM's arrays are at
/// their largest while this runs)
const CAP: u16 = 60_000;

/// The longest path (in the walk's levels) from `root` to any node, or None for a cycle (the
/// emitter refuses those anyway).
fn nesting_bound(vm: &Vm, root: Val) -> Option<u16> {
    let root = match root {
        Val::Node(n) => n,
        _ => return Some(0),
    };
    let mut height = vec![UNSEEN; vm.nodes.len()];
    let mut stack: Vec<(u32, bool)> = vec![(root, false)];
    let mut kids = Vec::new();
    while let Some((n, done)) = stack.pop() {
        let h = height[n as usize];
        if !done {
            if h != UNSEEN {
                continue; // finished through another path (OPEN would have been seen below)
            }
            height[n as usize] = OPEN;
            stack.push((n, true));
            kids.clear();
            children(vm, n, &mut kids);
            for &(v, _) in &kids {
                if let Val::Node(c) = v {
                    match height[c as usize] {
                        OPEN => return None,
                        UNSEEN => stack.push((c, false)),
                        _ => {}
                    }
                }
            }
        } else {
            kids.clear();
            children(vm, n, &mut kids);
            let mut best = 0u16;
            for &(v, w) in &kids {
                let below = match v {
                    Val::Node(c) => match height[c as usize] {
                        UNSEEN | OPEN => return None,
                        x => x,
                    },
                    _ => 0,
                };
                best = best.max(below.saturating_add(w).min(CAP));
            }
            height[n as usize] = best;
        }
    }
    Some(height[root as usize])
}

/// The meta pickle `head` (a framed tuple) with three more items: every tensor's storage (its
/// persistent id's index, u32 little-endian), its extent in bytes ([`needed`], i64), and the
/// nesting bound (-1 for unknown).
pub(super) fn extend_meta(vm: &Vm, head: &[u8], root: Val) -> Option<Vec<u8>> {
    // `head` is Out::framed's: 11 header bytes, the body, and "t." closing the tuple
    let body = head.get(11..head.len().checked_sub(2)?)?;
    let mut o = Out {
        buf: body.to_vec(),
        memo: 0,
    };
    let mut pids = Vec::with_capacity(vm.tensors.len() * 4);
    let mut extents = Vec::with_capacity(vm.tensors.len() * 8);
    for t in &vm.tensors {
        pids.extend_from_slice(&t.storage.to_le_bytes());
        extents.extend_from_slice(&needed(vm, t).to_le_bytes());
    }
    o.bytes(&pids);
    o.bytes(&extents);
    o.int(nesting_bound(vm, root).map_or(-1, i64::from));
    o.op(b"t.");
    Some(Out::framed(&o.buf))
}

/// `ckptfix_vm_extents`: OK (nothing) when every tensor's extent fits its storage, UNSUPPORTED
/// when one does not or is -1 (Python's `check_extents` then runs and says which). `pids` (u32)
/// and `needed` (i64) are [`extend_meta`]'s columns (little-endian); `sizes` is each persistent
/// id's storage size in bytes as the reader resolved it (native-endian i64: a Python array).
///
/// # Safety
/// Every (pointer, length) pair must be valid for reads during the call, `out` for one write.
#[no_mangle]
pub unsafe extern "C" fn ckptfix_vm_extents(
    pids: *const u8,
    pids_len: usize,
    needed: *const u8,
    needed_len: usize,
    sizes: *const u8,
    sizes_len: usize,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract (ffi conventions): valid for the call.
    let pids = unsafe { crate::ffi::input(pids, pids_len) };
    // SAFETY: as above.
    let needed = unsafe { crate::ffi::input(needed, needed_len) };
    // SAFETY: as above.
    let sizes = unsafe { crate::ffi::input(sizes, sizes_len) };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe {
        crate::ffi::guard(out, move || {
            Ok(extents_fit(pids, needed, sizes)?.then(Vec::new))
        })
    }
}

/// Whether every tensor's extent fits its storage ([`ckptfix_vm_extents`]).
pub fn extents_fit(pids: &[u8], needed: &[u8], sizes: &[u8]) -> Result<bool, String> {
    if !pids.len().is_multiple_of(4)
        || !needed.len().is_multiple_of(8)
        || !sizes.len().is_multiple_of(8)
        || pids.len() / 4 != needed.len() / 8
    {
        return Err("native extent check: columns of different lengths".to_string());
    }
    let word = |b: &[u8], little: bool| {
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        if little {
            i64::from_le_bytes(w)
        } else {
            i64::from_ne_bytes(w)
        }
    };
    for (p, n) in pids.chunks_exact(4).zip(needed.chunks_exact(8)) {
        let pid = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
        let need = word(n, true);
        let size = match sizes.get(8 * pid..8 * pid + 8) {
            Some(b) => word(b, false),
            None => return Ok(false),
        };
        if need < 0 || need > size {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::extents_fit;

    fn cols(pids: &[u32], needed: &[i64], sizes: &[i64]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        (
            pids.iter().flat_map(|p| p.to_le_bytes()).collect(),
            needed.iter().flat_map(|n| n.to_le_bytes()).collect(),
            sizes.iter().flat_map(|s| s.to_ne_bytes()).collect(),
        )
    }

    #[test]
    fn every_extent_must_fit_its_storage() {
        let (p, n, s) = cols(&[0, 1, 1], &[16, 0, 8], &[16, 8]);
        assert_eq!(extents_fit(&p, &n, &s), Ok(true));
        let (p, n, s) = cols(&[0, 1], &[17, 0], &[16, 8]);
        assert_eq!(extents_fit(&p, &n, &s), Ok(false)); // one byte past the end
        let (p, n, s) = cols(&[0], &[-1], &[16]);
        assert_eq!(extents_fit(&p, &n, &s), Ok(false)); // Python decides
        let (p, n, s) = cols(&[2], &[0], &[16, 8]);
        assert_eq!(extents_fit(&p, &n, &s), Ok(false)); // no such storage
        let (p, n, s) = cols(&[], &[], &[]);
        assert_eq!(extents_fit(&p, &n, &s), Ok(true));
    }

    #[test]
    fn columns_of_different_lengths_are_refused() {
        let (p, n, s) = cols(&[0, 0], &[1], &[16]);
        assert!(extents_fit(&p, &n, &s).is_err());
        assert!(extents_fit(&[0, 0, 0], &[], &[]).is_err());
        assert!(extents_fit(&[], &[], &[0; 7]).is_err());
    }
}
