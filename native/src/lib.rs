//! ckptfix's native core.
//!
//! The pure-Python engine (`ckptfix/pickling`, `ckptfix/fileio/ziparchive.py`) is the reference;
//! this crate runs its hot loops -- the ones that cost microseconds per tensor in Python -- with the
//! same semantics. Python loads the library with `ctypes` through a C ABI (see `ffi`), so one
//! build serves every Python version and no binding crate is needed (crates.io is not reachable
//! where ckptfix is built; see docs/engine.md for the choice).
//!
//! Rules for every module: safe Rust (only `ffi` touches raw pointers), no allocation sized by a
//! number read from the input before that number is checked against the bytes really there,
//! checked arithmetic on every length and offset, iteration instead of recursion.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(clippy::undocumented_unsafe_blocks)]

pub mod cast;
pub mod copyrange;
pub mod crc;
pub mod emit;
pub mod emit_py;
pub mod ffi;
pub mod gather;
pub mod le;
pub mod vm;
pub mod vm_records;
pub mod zip;
pub mod zipcopy;
pub mod zipsources;
pub mod zipwrite;

/// Bumped whenever an exported function changes its signature or meaning; the Python side
/// refuses a library built for another ABI (a stale build left in an editable checkout).
pub const ABI_VERSION: u32 = 1;
