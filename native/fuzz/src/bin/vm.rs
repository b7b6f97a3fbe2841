//! libFuzzer target: the native pickle VM over arbitrary bytes, with the reader's allow-list
//! and budgets scaled to the input as `pickling/vm.py` scales them. It must answer (a tree, or
//! "leave it to Python") and never panic, overflow or run past its budgets.
#![no_main]

use ckptfix_native::vm::{load, Budgets, Config};
use std::sync::OnceLock;

static CONFIG: OnceLock<Config> = OnceLock::new();

/// # Safety
/// libFuzzer's contract: `data` is valid for reads of `size` bytes during the call.
#[no_mangle]
pub unsafe extern "C" fn LLVMFuzzerTestOneInput(data: *const u8, size: usize) -> i32 {
    // SAFETY: libFuzzer passes a buffer valid for `size` bytes for the duration of the call.
    let input: &[u8] = if size == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(data, size) }
    };
    let config =
        CONFIG.get_or_init(|| Config::parse(ckptfix_native_fuzz::TABLE).expect("table.txt parses"));
    let (has_loader, pickle) = match input.split_first() {
        Some((flag, rest)) => (flag & 1 == 1, rest),
        None => (true, input),
    };
    let len = pickle.len() as u64;
    let budgets = Budgets {
        max_objects: (1 << 16) + len,
        max_alloc: (64 << 20) + 32 * len,
        max_memo: (1 << 16) + len,
    };
    let _ = load(pickle, 0, pickle.len(), config, budgets, has_loader);
    0
}
