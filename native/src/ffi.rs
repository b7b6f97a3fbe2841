//! The C ABI: how bytes cross between Python (`ctypes`) and the crate.
//!
//! Conventions, the same for every exported function:
//!
//! * inputs are `(pointer, length)` pairs that Python keeps alive for the call; they become
//!   `&[u8]` here through [`input`] and nothing keeps them after the call returns;
//! * outputs are [`OutBuf`]s: a `Vec<u8>` handed over whole ([`give`]); Python copies it and
//!   gives it back with `ckptfix_free`, so allocation and release happen in the same allocator;
//! * the return value is a [`Status`]: `Ok`, `Unsupported` (the input uses something this engine
//!   leaves to the Python reference engine, which then runs instead: same result by
//!   construction), `BadInput` (the output buffer holds a one-line UTF-8 message) or `Internal`
//!   (a panic, caught here: a bug, reported as exit 5, never a dead process).

use std::panic::{catch_unwind, UnwindSafe};

/// What an exported function returns (as `i32`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    Unsupported = 1,
    BadInput = 2,
    Internal = 3,
}

/// A byte buffer owned by this library until Python hands it back to `ckptfix_free`.
#[repr(C)]
#[derive(Debug)]
pub struct OutBuf {
    pub ptr: *mut u8,
    pub len: usize,
    pub cap: usize,
}

impl OutBuf {
    /// The empty buffer (nothing to free).
    pub const EMPTY: OutBuf = OutBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
        cap: 0,
    };
}

/// Hand `bytes` over to the caller.
pub fn give(bytes: Vec<u8>) -> OutBuf {
    let mut bytes = std::mem::ManuallyDrop::new(bytes);
    OutBuf {
        ptr: bytes.as_mut_ptr(),
        len: bytes.len(),
        cap: bytes.capacity(),
    }
}

/// Release a buffer made by [`give`].
///
/// # Safety
/// `buf` must come from this library (an `OutBuf` it returned) and be freed once.
#[no_mangle]
pub unsafe extern "C" fn ckptfix_free(buf: OutBuf) {
    if !buf.ptr.is_null() {
        // SAFETY: ptr/len/cap are exactly those of a Vec<u8> leaked by `give`, freed once.
        drop(unsafe { Vec::from_raw_parts(buf.ptr, buf.len, buf.cap) });
    }
}

/// Borrow an input buffer for the duration of a call.
///
/// # Safety
/// `ptr` must point to `len` readable bytes that stay valid and unchanged during the call (or
/// `len` is 0).
pub unsafe fn input<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if len == 0 || ptr.is_null() {
        &[]
    } else {
        // SAFETY: the caller's contract above.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

/// Run `body`, turning its result into a status and its output (or message) into `out`.
///
/// `Err(message)` from the body is a `BadInput` with that message; a panic is `Internal` with
/// the panic's text, so a bug in the native engine surfaces as one line, not an abort.
///
/// # Safety
/// `out` is null or valid for one write of an `OutBuf` (the caller's out-parameter).
pub unsafe fn guard<F>(out: *mut OutBuf, body: F) -> i32
where
    F: FnOnce() -> Result<Option<Vec<u8>>, String> + UnwindSafe,
{
    let (status, bytes) = match catch_unwind(body) {
        Ok(Ok(Some(bytes))) => (Status::Ok, bytes),
        Ok(Ok(None)) => (Status::Unsupported, Vec::new()),
        Ok(Err(message)) => (Status::BadInput, message.into_bytes()),
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".to_string());
            (
                Status::Internal,
                format!("native engine bug: {text}").into_bytes(),
            )
        }
    };
    if !out.is_null() {
        // SAFETY: `out` is the caller's out-parameter, valid for one write.
        unsafe { out.write(give(bytes)) };
    }
    status as i32
}

/// The ABI version this library was built for (see [`crate::ABI_VERSION`]).
#[no_mangle]
pub extern "C" fn ckptfix_abi_version() -> u32 {
    crate::ABI_VERSION
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Call `guard` and take its output back as a Vec (freeing the buffer).
    fn run<F>(body: F) -> (i32, Vec<u8>)
    where
        F: FnOnce() -> Result<Option<Vec<u8>>, String> + UnwindSafe,
    {
        let mut out = OutBuf::EMPTY;
        // SAFETY: `out` is a local, valid for the write.
        let status = unsafe { guard(&mut out, body) };
        // SAFETY: `out` was filled by `guard` with a buffer from `give`, read then freed once.
        let bytes = unsafe { input(out.ptr, out.len) }.to_vec();
        // SAFETY: as above.
        unsafe { ckptfix_free(out) };
        (status, bytes)
    }

    #[test]
    fn guard_reports_each_status() {
        assert_eq!(
            run(|| Ok(Some(b"abc".to_vec()))),
            (Status::Ok as i32, b"abc".to_vec())
        );
        assert_eq!(run(|| Ok(None)), (Status::Unsupported as i32, vec![]));
        assert_eq!(
            run(|| Err("bad".into())),
            (Status::BadInput as i32, b"bad".to_vec())
        );
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let caught = run(|| panic!("boom"));
        std::panic::set_hook(prev);
        assert_eq!(
            caught,
            (Status::Internal as i32, b"native engine bug: boom".to_vec())
        );
    }
}
