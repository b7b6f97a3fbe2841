//! One big range copied file to file through a buffer, its CRC-32 computed on the way.
//!
//! Why: a zip record copied from a zip input must be checked against the CRC its source
//! recorded (a corrupt record must not pass on with its old CRC), and a record copied from a
//! safetensors file needs a CRC computed. The kernel's `copy_file_range` never shows the bytes
//! to the process, so the CRC needed a second read of the source beside it: every byte read
//! twice. Here each piece is read once into a buffer that stays in the CPU's cache, its CRC
//! folded there (`crc::crc32`, ~10 GB/s) and the same piece written out: one read of the source
//! (issue 26, `strip-module` on large tensors against `cp`). It runs only where the kernel's
//! copy could not share blocks anyway (ext4, tmpfs: the Python side decides), and it is the
//! same loop as `fileio/ranges.py`'s `_bounce_copy` (the reference), without a Python call per
//! piece.
//!
//! The buffer starts at a chosen offset within a memory page: a copy whose destination lies
//! just after its source modulo the page size runs at half speed on x86 (`rep movsb`, loads
//! aliasing the stores just made); the caller passes where it should start (the reference's
//! `_buffer_page_offset`).
//!
//! Anything but a complete copy -- an I/O error, a source that ends early, a write that makes
//! no progress -- returns `None`: Python then copies the range itself from the start (writes
//! are positional, so redoing them is harmless) and raises its own error in its own words
//! (exit 3 for a truncated input, 4 for a full disk).

use std::io;

use crate::zipcopy::ReadAt;

/// The piece read, checksummed and written at a time: small enough to stay in the CPU's cache
/// between the three (the reference's `_BOUNCE`, measured: 256 KiB beat 1 MiB by ~20%).
pub const PIECE: usize = 1 << 18;
/// The page size the buffer is placed in (and the block a copy-on-write file system shares).
pub const PAGE: usize = 4096;

/// A destination written by offset (a file by `pwrite`; memory in tests).
pub trait WriteAt {
    /// Write from `buf` at `offset`; the count written.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;
}

#[cfg(unix)]
impl WriteAt for std::fs::File {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::write_at(self, buf, offset)
    }
}

/// A buffer of `len` bytes starting `page_offset` bytes into a page (its backing `Vec` is
/// `PAGE` longer, and the slice starts where the address is right).
fn placed_buffer(storage: &mut Vec<u8>, len: usize, page_offset: usize) -> Option<&mut [u8]> {
    storage.clear();
    storage.resize(len.checked_add(PAGE)?, 0);
    let address = storage.as_ptr() as usize;
    let start = (page_offset % PAGE + PAGE - address % PAGE) % PAGE;
    storage.get_mut(start..start.checked_add(len)?)
}

/// Fill `buf` from `source` at `offset`; false where the source ends first or fails.
fn read_exact_at<R: ReadAt + ?Sized>(source: &R, buf: &mut [u8], offset: u64) -> bool {
    let mut got = 0usize;
    while got < buf.len() {
        let Some(at) = offset.checked_add(got as u64) else {
            return false;
        };
        match source.read_at(&mut buf[got..], at) {
            Ok(0) => return false,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

/// Write all of `buf` to `dest` at `offset`; false on an error or a write that makes no progress.
fn write_all_at<W: WriteAt + ?Sized>(dest: &W, buf: &[u8], offset: u64) -> bool {
    let mut put = 0usize;
    while put < buf.len() {
        let Some(at) = offset.checked_add(put as u64) else {
            return false;
        };
        match dest.write_at(&buf[put..], at) {
            Ok(0) => return false,
            Ok(n) => put += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

/// Copy `count` bytes of `source` at `src_offset` to `dest` at `dst_offset` through one buffer
/// of [`PIECE`] bytes placed `page_offset` into a page; the CRC-32 of the bytes copied when
/// `want_crc` (else 0). `None`: not copied in full (see the module's doc).
pub fn copy_range<R: ReadAt + ?Sized, W: WriteAt + ?Sized>(
    source: &R,
    src_offset: u64,
    dest: &W,
    dst_offset: u64,
    count: u64,
    page_offset: usize,
    want_crc: bool,
) -> Option<u32> {
    src_offset.checked_add(count)?;
    dst_offset.checked_add(count)?;
    let len = usize::try_from(count.min(PIECE as u64)).ok()?;
    let mut storage = Vec::new();
    let buf = placed_buffer(&mut storage, len, page_offset)?;
    let mut crc = 0u32;
    let mut done = 0u64;
    while done < count {
        let want = usize::try_from((count - done).min(len as u64)).ok()?;
        let piece = &mut buf[..want];
        if !read_exact_at(source, piece, src_offset + done) {
            return None;
        }
        if want_crc {
            crc = crate::crc::crc32(crc, piece);
        }
        if !write_all_at(dest, piece, dst_offset + done) {
            return None;
        }
        done += want as u64;
    }
    Some(crc)
}

/// `ckptfix_copy_range(src_fd, src_offset, dst_fd, dst_offset, count, page_offset, want_crc,
/// result, out)`: [`copy_range`] between two open file descriptors (borrowed: not closed), the
/// CRC written to `*result`. Unsupported: not copied in full (Python copies it instead and
/// raises its own error), a negative descriptor, a platform without `pread`/`pwrite`. ctypes
/// releases the GIL for the call.
///
/// # Safety
/// `src_fd` and `dst_fd` are open file descriptors the caller keeps open for the call;
/// `result` is valid for one write of a `u32`; `out` as [`crate::ffi::guard`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckptfix_copy_range(
    src_fd: i32,
    src_offset: u64,
    dst_fd: i32,
    dst_offset: u64,
    count: u64,
    page_offset: u32,
    want_crc: u32,
    result: *mut u32,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    let result_at = result as usize; // carried into the closure as a number (UnwindSafe)
    #[cfg(unix)]
    let body = move || -> Result<Option<Vec<u8>>, String> {
        use std::os::fd::FromRawFd;
        if result_at == 0 {
            return Err("ckptfix_copy_range: no place for the result".to_string());
        }
        if src_fd < 0 || dst_fd < 0 {
            return Ok(None);
        }
        // SAFETY: the caller's contract: both are open descriptors for the whole call. The
        // Files are never dropped (ManuallyDrop), so the caller's descriptors stay open.
        let (source, dest) = unsafe {
            (
                std::mem::ManuallyDrop::new(std::fs::File::from_raw_fd(src_fd)),
                std::mem::ManuallyDrop::new(std::fs::File::from_raw_fd(dst_fd)),
            )
        };
        let page_offset = usize::try_from(page_offset).map_err(|e| e.to_string())?;
        let Some(crc) = copy_range(
            &*source,
            src_offset,
            &*dest,
            dst_offset,
            count,
            page_offset,
            want_crc != 0,
        ) else {
            return Ok(None);
        };
        // SAFETY: `result` is the caller's out-parameter, non-null, valid for one write.
        unsafe { (result_at as *mut u32).write(crc) };
        Ok(Some(Vec::new()))
    };
    #[cfg(not(unix))]
    let body = move || -> Result<Option<Vec<u8>>, String> {
        let _ = (
            src_fd,
            src_offset,
            dst_fd,
            dst_offset,
            count,
            page_offset,
            want_crc,
            result_at,
        );
        Ok(None)
    };
    // SAFETY: `out` is null or the caller's out-parameter, valid for one write.
    unsafe { crate::ffi::guard(out, body) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A destination in memory that can be told to fail or stall after some bytes.
    struct Sink {
        bytes: RefCell<Vec<u8>>,
        fail_at: Option<u64>,
    }

    impl WriteAt for Sink {
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
            let end = offset + buf.len() as u64;
            if let Some(limit) = self.fail_at {
                if end > limit {
                    return Err(io::Error::other("no space"));
                }
            }
            let mut bytes = self.bytes.borrow_mut();
            if bytes.len() < end as usize {
                bytes.resize(end as usize, 0);
            }
            bytes[offset as usize..end as usize].copy_from_slice(buf);
            Ok(buf.len())
        }
    }

    fn sink() -> Sink {
        Sink {
            bytes: RefCell::new(Vec::new()),
            fail_at: None,
        }
    }

    /// A source that hands out a few bytes per read (as a pipe or a signal-interrupted read may).
    struct Trickle<'a>(&'a [u8]);

    impl ReadAt for Trickle<'_> {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            let n = buf.len().min(7);
            self.0.read_at(&mut buf[..n], offset)
        }
    }

    fn noise(len: usize) -> Vec<u8> {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn copies_and_checksums_any_length() {
        let data = noise(3 * PIECE + 1234);
        for (start, count) in [
            (0, 0),
            (0, 1),
            (5, 100),
            (0, PIECE),
            (1, PIECE + 1),
            (17, 3 * PIECE),
        ] {
            for page_offset in [0, 8, 2048, 4095, 5000] {
                let out = sink();
                let crc = copy_range(
                    &data[..],
                    start as u64,
                    &out,
                    3,
                    count as u64,
                    page_offset,
                    true,
                );
                let piece = &data[start..start + count];
                assert_eq!(crc, Some(crate::crc::crc32(0, piece)));
                assert_eq!(out.bytes.borrow().get(3..).unwrap_or(&[]), piece);
                let plain = sink();
                let crc = copy_range(&data[..], start as u64, &plain, 0, count as u64, 0, false);
                assert_eq!((crc, &plain.bytes.borrow()[..]), (Some(0), piece));
            }
        }
    }

    #[test]
    fn short_reads_are_retried() {
        let data = noise(PIECE + 99);
        let out = sink();
        let crc = copy_range(&Trickle(&data), 0, &out, 0, data.len() as u64, 0, true);
        assert_eq!(crc, Some(crate::crc::crc32(0, &data)));
        assert_eq!(*out.bytes.borrow(), data);
    }

    #[test]
    fn a_source_that_ends_early_or_a_failed_write_is_left_to_python() {
        let data = noise(1000);
        assert_eq!(copy_range(&data[..], 0, &sink(), 0, 1001, 0, true), None);
        assert_eq!(copy_range(&data[..], 999, &sink(), 0, 2, 0, true), None);
        let full = Sink {
            bytes: RefCell::new(Vec::new()),
            fail_at: Some(500),
        };
        assert_eq!(copy_range(&data[..], 0, &full, 0, 1000, 0, true), None);
        assert_eq!(
            copy_range(&data[..], u64::MAX, &sink(), 0, 2, 0, true),
            None
        );
        assert_eq!(
            copy_range(&data[..], 0, &sink(), u64::MAX, 2, 0, true),
            None
        );
    }

    #[test]
    fn the_buffer_starts_where_asked() {
        let mut storage = Vec::new();
        for want in [0, 1, 64, 2048, 4095] {
            let buf = placed_buffer(&mut storage, 10_000, want).expect("fits");
            assert_eq!(buf.len(), 10_000);
            assert_eq!(buf.as_ptr() as usize % PAGE, want);
        }
    }

    #[cfg(unix)]
    #[test]
    fn exported_function_between_files() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("ckptfix-copyrange-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let data = noise(PIECE + 4321);
        let src_path = dir.join("src");
        std::fs::File::create(&src_path)
            .and_then(|mut f| f.write_all(&data))
            .expect("write source");
        let src = std::fs::File::open(&src_path).expect("open source");
        let dst = std::fs::File::create(dir.join("dst")).expect("create dest");
        let (mut result, mut out) = (0u32, crate::ffi::OutBuf::EMPTY);
        let call = |count: u64, result: &mut u32, out: &mut crate::ffi::OutBuf| {
            // SAFETY: both descriptors are open for the call; `result` and `out` are locals.
            unsafe {
                ckptfix_copy_range(
                    src.as_raw_fd(),
                    10,
                    dst.as_raw_fd(),
                    4096,
                    count,
                    2048,
                    1,
                    result,
                    out,
                )
            }
        };
        let n = (data.len() - 10) as u64;
        assert_eq!(
            call(n, &mut result, &mut out),
            crate::ffi::Status::Ok as i32
        );
        assert_eq!(result, crate::crc::crc32(0, &data[10..]));
        let written = std::fs::read(dir.join("dst")).expect("read dest");
        assert_eq!(&written[4096..], &data[10..]);
        // the source ends first: left to Python
        assert_eq!(
            call(n + 1, &mut result, &mut out),
            crate::ffi::Status::Unsupported as i32
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
