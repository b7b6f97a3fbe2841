//! Many small ranges of one file read into one buffer, end to end: the bytes of a training
//! checkpoint's ~50 000 small tensors for a safetensors file, or for a `--dtype` cast, in one
//! call instead of a Python read per tensor. The ranges are mostly in file order a few hundred
//! bytes apart (zip records), so they are served from windows of [`WINDOW`] bytes, one `pread`
//! each.
//!
//! Nothing is sized by the input before it is checked: the caller's total is bounded
//! ([`MAX_BYTES`]) and each range is read before its bytes are kept, so a range past the end
//! of the file makes the call UNSUPPORTED (the Python reader then raises its own error).

use std::io;

use crate::zipcopy::ReadAt;

/// Bytes read ahead per `pread`.
pub const WINDOW: u64 = 1 << 18;
/// The most bytes one call gathers (the caller cuts its batches far below this).
pub const MAX_BYTES: u64 = 256 << 20;

/// Read exactly `buf.len()` bytes at `offset`, or None (the file ends first, or a read fails).
fn read_exact<R: ReadAt + ?Sized>(source: &R, buf: &mut [u8], offset: u64) -> Option<usize> {
    let mut got = 0usize;
    while got < buf.len() {
        match source.read_at(&mut buf[got..], offset.checked_add(got as u64)?) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(got)
}

/// The ranges `(offset, size)` of `source`, end to end; None where one is not all in the file.
pub fn gather<R: ReadAt + ?Sized>(source: &R, ranges: &[(u64, u64)]) -> Option<Vec<u8>> {
    let mut total = 0u64;
    for &(offset, size) in ranges {
        offset.checked_add(size)?;
        total = total.checked_add(size)?;
    }
    if total > MAX_BYTES {
        return None;
    }
    let mut out = Vec::with_capacity(usize::try_from(total).ok()?);
    let mut window: Vec<u8> = Vec::new();
    let mut start = 0u64;
    for &(offset, size) in ranges {
        let end = offset + size; // checked above
        let held = offset >= start && end <= start + window.len() as u64;
        if !held {
            if size >= WINDOW {
                // a big one: straight into the output
                let at = out.len();
                out.resize(at + usize::try_from(size).ok()?, 0);
                if read_exact(source, &mut out[at..], offset)? as u64 != size {
                    return None;
                }
                continue;
            }
            window.clear();
            window.resize(WINDOW as usize, 0);
            let got = read_exact(source, &mut window, offset)?;
            window.truncate(got);
            start = offset;
        }
        let at = usize::try_from(offset - start).ok()?;
        out.extend_from_slice(window.get(at..at + usize::try_from(size).ok()?)?);
    }
    Some(out)
}

/// Gather the ranges (`u64 offsets[n]`, `u64 sizes[n]`, native byte order) of the open file
/// `fd`. UNSUPPORTED: a range not all in the file (the Python reader raises its error), a total
/// over [`MAX_BYTES`], a platform without `pread`.
///
/// # Safety
/// Each `(ptr, len)` as [`crate::ffi::input`]; `fd` is an open file descriptor the caller keeps
/// open for the call; `out` as [`crate::ffi::guard`].
#[no_mangle]
pub unsafe extern "C" fn ckptfix_gather_ranges(
    fd: i32,
    offsets_ptr: *const u8,
    offsets_len: usize,
    sizes_ptr: *const u8,
    sizes_len: usize,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller keeps each buffer alive and unchanged for the call.
    let offsets = unsafe { crate::ffi::input(offsets_ptr, offsets_len) };
    // SAFETY: as above.
    let sizes = unsafe { crate::ffi::input(sizes_ptr, sizes_len) };
    let body = move || {
        if offsets.len() != sizes.len() || !offsets.len().is_multiple_of(8) {
            return Err("ckptfix_gather_ranges: columns of different lengths".to_string());
        }
        let u64s = |b: &[u8]| -> Vec<u64> {
            b.chunks_exact(8)
                .map(|c| u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect()
        };
        let ranges: Vec<(u64, u64)> = u64s(offsets).into_iter().zip(u64s(sizes)).collect();
        #[cfg(unix)]
        {
            use std::os::unix::io::FromRawFd;
            if fd < 0 {
                return Err("ckptfix_gather_ranges: no file".to_string());
            }
            // SAFETY: the caller's contract: `fd` is an open descriptor for the whole call.
            // The File is never dropped (ManuallyDrop), so the caller's descriptor stays open.
            let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
            Ok(gather(&*file, &ranges))
        }
        #[cfg(not(unix))]
        {
            let _ = (fd, ranges);
            Ok(None)
        }
    };
    // SAFETY: `out` is null or the caller's out-parameter, valid for one write.
    unsafe { crate::ffi::guard(out, body) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_in_and_out_of_order() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1 << 20).collect();
        let ranges = [(10, 5), (3, 2), (600_000, 4), (0, 0), (1 << 19, WINDOW + 3)];
        let got = gather(&data[..], &ranges).unwrap();
        let mut want = Vec::new();
        for (o, s) in ranges {
            want.extend_from_slice(&data[o as usize..(o + s) as usize]);
        }
        assert_eq!(got, want);
    }

    #[test]
    fn a_range_past_the_end_is_unsupported() {
        let data = [7u8; 100];
        assert!(gather(&data[..], &[(90, 10)]).is_some());
        assert!(gather(&data[..], &[(90, 11)]).is_none());
        assert!(gather(&data[..], &[(u64::MAX, 2)]).is_none());
        assert!(gather(&data[..], &[(0, MAX_BYTES + 1)]).is_none());
    }
}
