//! Small records copied from their source files into the zip writer's output, as a run:
//! what `ZipWriter.add_copy` does for each record below 64 KiB (`SMALL_COPY`) -- read its bytes,
//! compute their CRC-32, check it against the CRC the source recorded, lay out local header,
//! padding, data and descriptor (`zipwrite::small_record`) -- for thousands of records per call,
//! from columns (a training checkpoint has ~4 such records per parameter: a Python call each
//! cost ~10 us).
//!
//! Semantics are the reference's (`ckptfix/fileio/ziparchive.py`): a recorded CRC of 0 marks a
//! file saved with torch's CRCs off and is kept as 0, unchecked; any other recorded CRC must
//! match the bytes read (never trusted: copying a wrong CRC along would make a corrupt output
//! pass every check); no recorded CRC means the computed one is written. Anything the reference
//! would refuse or report -- a CRC mismatch, a file that ends inside a record, a read error, a
//! value too wide for its field -- makes this return `None`: Python then writes the run record
//! by record and raises its own error, in its own words, before anything of the run is written.

use std::io;

use crate::zipwrite::{small_record, Items};

/// Bytes read ahead per `pread`: records are mostly in file order, a few hundred bytes apart.
pub const WINDOW: u64 = 1 << 18;
/// The most record bytes one call takes (the caller cuts runs to ~1 MiB; this bounds memory
/// whatever it passes).
pub const MAX_BYTES: u64 = 64 << 20;

/// A source read by offset (a file by `pread`; bytes in memory in tests).
pub trait ReadAt {
    /// Read into `buf` from `offset`; the count read, 0 at the end.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
}

#[cfg(unix)]
impl ReadAt for std::fs::File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
}

impl ReadAt for [u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(self.len());
        let n = buf.len().min(self.len() - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
}

/// A source with no bytes (a file the caller did not open).
pub struct Empty;

impl ReadAt for Empty {
    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> io::Result<usize> {
        Ok(0)
    }
}

/// One record to copy: which source, where, how long, and the CRC the source recorded.
#[derive(Clone, Copy, Debug)]
pub struct Record {
    pub file: usize,
    pub offset: u64,
    pub size: u64,
    pub crc: Option<u32>,
}

/// The bytes last read from one source.
struct Window {
    file: usize,
    start: u64,
    buf: Vec<u8>,
}

impl Window {
    /// `len` bytes of `source` from `offset` (fewer where the file ends), as `fill` leaves them.
    fn fill<R: ReadAt + ?Sized>(
        &mut self,
        file: usize,
        source: &R,
        offset: u64,
        len: u64,
    ) -> Option<()> {
        let len = usize::try_from(len).ok()?;
        self.file = file;
        self.start = offset;
        self.buf.clear();
        self.buf.resize(len, 0);
        let mut got = 0usize;
        while got < len {
            match source.read_at(&mut self.buf[got..], offset.checked_add(got as u64)?) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        self.buf.truncate(got);
        Some(())
    }

    /// The record's bytes, reading a new window where the current one does not hold them.
    fn bytes<R: ReadAt + ?Sized>(&mut self, sources: &[&R], r: &Record) -> Option<&[u8]> {
        let end = r.offset.checked_add(r.size)?;
        let held = self.file == r.file
            && r.offset >= self.start
            && end <= self.start + self.buf.len() as u64;
        if !held {
            self.fill(r.file, *sources.get(r.file)?, r.offset, r.size.max(WINDOW))?;
        }
        let at = usize::try_from(r.offset - self.start).ok()?;
        let size = usize::try_from(r.size).ok()?;
        self.buf.get(at..at.checked_add(size)?) // None: the file ended inside the record
    }
}

/// Copy `records` (named `names`, full names with the archive folder) as small zip records
/// written from `offset` on, zip64 from `threshold` on. Output: the records' bytes, then
/// `i64 header_offsets[n]`, then `u32 crcs[n]` (each record's CRC as written). `None`: leave
/// the run to the Python writer (see the module's doc).
pub fn copy_records<R: ReadAt + ?Sized>(
    sources: &[&R],
    records: &[Record],
    names: &Items<'_>,
    offset: u64,
    threshold: u64,
) -> Option<Vec<u8>> {
    let n = records.len();
    if names.len() != n {
        return None;
    }
    let mut total = 0u64;
    for r in records {
        total = total.checked_add(r.size)?;
    }
    if total > MAX_BYTES {
        return None;
    }
    let capacity = usize::try_from(total).ok()? + names.blob_len() + n * (30 + 64 + 24 + 12);
    let mut out = Vec::with_capacity(capacity);
    let mut offsets = Vec::with_capacity(n);
    let mut crcs = Vec::with_capacity(n);
    let mut window = Window {
        file: usize::MAX,
        start: 0,
        buf: Vec::new(),
    };
    let mut at = offset;
    for (i, r) in records.iter().enumerate() {
        let data: &[u8] = if r.size == 0 {
            &[]
        } else {
            window.bytes(sources, r)?
        };
        let crc = match r.crc {
            Some(0) => 0, // saved with torch's CRCs off: kept so, unchecked (as the reference)
            recorded => {
                let actual = crate::crc::crc32(0, data);
                if recorded.is_some_and(|c| c != actual) {
                    return None; // corrupt input: the reference words the refusal
                }
                actual
            }
        };
        let before = out.len();
        small_record(&mut out, at, names.get(i), data, crc, threshold)?;
        offsets.push(at);
        crcs.push(crc);
        at = at.checked_add((out.len() - before) as u64)?;
    }
    for o in offsets {
        out.extend_from_slice(&i64::try_from(o).ok()?.to_le_bytes());
    }
    for c in crcs {
        out.extend_from_slice(&c.to_le_bytes());
    }
    Some(out)
}

/// The records' columns as the FFI passes them: `u32 files[n]`, `i64 offsets[n]`,
/// `i64 sizes[n]`, `i64 crcs[n]` (-1: none recorded). `None` for a column of the wrong length
/// or a value out of range.
pub fn records_of(files: &[u8], offsets: &[u8], sizes: &[u8], crcs: &[u8]) -> Option<Vec<Record>> {
    use crate::zipwrite::{u32_word, u64_word, words};
    let n = files.len() / 4;
    let files = words(files, n, u32_word)?;
    let offsets = words(offsets, n, u64_word)?;
    let sizes = words(sizes, n, u64_word)?;
    let crcs = words(crcs, n, u64_word)?;
    let mut records = Vec::with_capacity(n);
    for i in 0..n {
        let (offset, size, crc) = (offsets[i] as i64, sizes[i] as i64, crcs[i] as i64);
        if offset < 0 || size < 0 || !(-1..=i64::from(u32::MAX)).contains(&crc) {
            return None;
        }
        let crc = if crc < 0 { None } else { Some(crc as u32) };
        records.push(Record {
            file: files[i] as usize,
            offset: offset as u64,
            size: size as u64,
            crc,
        });
    }
    Some(records)
}

/// Small records copied from open files: `i32 fds[k]` (the sources, borrowed: not closed; -1
/// for one no record of this call reads),
/// the record columns of [`records_of`], names (`blob`, `u64 ends[n]`), written from `offset`
/// with zip64 from `threshold` on. Output as [`copy_records`]. Unsupported: what the Python
/// writer does otherwise (see the module's doc), and platforms without `pread`.
///
/// # Safety
/// Every `(ptr, len)` as [`crate::ffi::input`]; each fd is an open file descriptor the caller
/// keeps open for the call; `out` as [`crate::ffi::guard`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckptfix_zip_copy_records(
    fds_ptr: *const u8,
    fds_len: usize,
    files_ptr: *const u8,
    files_len: usize,
    offsets_ptr: *const u8,
    offsets_len: usize,
    sizes_ptr: *const u8,
    sizes_len: usize,
    crcs_ptr: *const u8,
    crcs_len: usize,
    names_ptr: *const u8,
    names_len: usize,
    name_ends_ptr: *const u8,
    name_ends_len: usize,
    offset: u64,
    threshold: u64,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract: each (ptr, len) is readable for the call.
    let (fds, files, offsets, sizes, crcs, names, name_ends) = unsafe {
        (
            crate::ffi::input(fds_ptr, fds_len),
            crate::ffi::input(files_ptr, files_len),
            crate::ffi::input(offsets_ptr, offsets_len),
            crate::ffi::input(sizes_ptr, sizes_len),
            crate::ffi::input(crcs_ptr, crcs_len),
            crate::ffi::input(names_ptr, names_len),
            crate::ffi::input(name_ends_ptr, name_ends_len),
        )
    };
    #[cfg(unix)]
    let body = || -> Result<Option<Vec<u8>>, String> {
        use std::os::fd::FromRawFd;
        let Some(records) = records_of(files, offsets, sizes, crcs) else {
            return Ok(None);
        };
        let Some(name_ends) =
            crate::zipwrite::words(name_ends, records.len(), crate::zipwrite::u64_word)
        else {
            return Ok(None);
        };
        let Some(names) = Items::new(names, &name_ends) else {
            return Ok(None);
        };
        if fds.len() % 4 != 0 {
            return Ok(None);
        }
        let mut files = Vec::with_capacity(fds.len() / 4);
        for word in fds.chunks_exact(4) {
            let fd = i32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            // a negative fd: a file not opened (no record of this call reads it; one that did
            // would read nothing and be left to Python, which opens it)
            files.push((fd >= 0).then(|| {
                // SAFETY: the caller's contract: `fd` is an open descriptor for the whole call.
                // The File is never dropped (ManuallyDrop), so the caller's descriptor stays open.
                std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) })
            }));
        }
        let sources: Vec<&dyn ReadAt> = files
            .iter()
            .map(|f| {
                f.as_ref()
                    .map_or(&Empty as &dyn ReadAt, |f| &**f as &dyn ReadAt)
            })
            .collect();
        Ok(copy_records(&sources, &records, &names, offset, threshold))
    };
    #[cfg(not(unix))]
    let body = || -> Result<Option<Vec<u8>>, String> {
        let _ = (
            fds, files, offsets, sizes, crcs, names, name_ends, offset, threshold,
        );
        Ok(None)
    };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe { crate::ffi::guard(out, body) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zipwrite::small_records;

    fn ends(items: &[&[u8]]) -> (Vec<u8>, Vec<u64>) {
        let mut blob = Vec::new();
        let mut ends = Vec::new();
        for item in items {
            blob.extend_from_slice(item);
            ends.push(blob.len() as u64);
        }
        (blob, ends)
    }

    /// Copying records gives the bytes `small_records` lays out for the same data and CRCs.
    #[test]
    fn copies_are_small_records_of_the_source_bytes() {
        let file: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let other: Vec<u8> = vec![9u8; 1000];
        let spans = [
            (0usize, 0u64, 10u64),
            (0, 10, 0),
            (1, 5, 100),
            (0, 2_000_000, 60_000),
            (0, 100, 3),
            (1, 0, 1000),
        ];
        let names: Vec<Vec<u8>> = (0..spans.len())
            .map(|i| format!("archive/data/{i}").into_bytes())
            .collect();
        let name_refs: Vec<&[u8]> = names.iter().map(|n| n.as_slice()).collect();
        let (name_blob, name_ends) = ends(&name_refs);
        let names = Items::new(&name_blob, &name_ends).unwrap();
        let sources: [&[u8]; 2] = [&file, &other];
        let datas: Vec<&[u8]> = spans
            .iter()
            .map(|&(f, o, s)| &sources[f][o as usize..(o + s) as usize])
            .collect();
        let real: Vec<u32> = datas.iter().map(|d| crate::crc::crc32(0, d)).collect();
        for threshold in [u64::from(u32::MAX), 1_000, 1] {
            // recorded CRCs: none, the right one, and 0 (kept as 0)
            let recorded = [None, Some(real[1]), None, Some(real[3]), Some(0), None];
            let records: Vec<Record> = spans
                .iter()
                .zip(recorded)
                .map(|(&(file, offset, size), crc)| Record {
                    file,
                    offset,
                    size,
                    crc,
                })
                .collect();
            let got = copy_records(&sources, &records, &names, 777, threshold).unwrap();
            let written: Vec<u32> = recorded
                .iter()
                .zip(&real)
                .map(|(r, c)| if *r == Some(0) { 0 } else { *c })
                .collect();
            let (data_blob, data_ends) = ends(&datas);
            let crc_words: Vec<u32> = written.clone();
            let expected = small_records(
                &names,
                &Items::new(&data_blob, &data_ends).unwrap(),
                &crc_words,
                777,
                threshold,
            )
            .unwrap();
            let n = spans.len();
            assert_eq!(&got[..got.len() - 4 * n], &expected[..]);
            let tail: Vec<u32> = got[got.len() - 4 * n..]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(tail, written);
        }
    }

    #[test]
    fn declines_what_the_reference_refuses() {
        let file: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let sources: [&[u8]; 1] = [&file];
        let (blob, name_ends) = ends(&[b"a"]);
        let names = Items::new(&blob, &name_ends).unwrap();
        let ok = crate::crc::crc32(0, &file[10..20]);
        let run = |r: Record| copy_records(&sources, &[r], &names, 0, u64::from(u32::MAX));
        assert!(run(Record {
            file: 0,
            offset: 10,
            size: 10,
            crc: Some(ok)
        })
        .is_some());
        assert!(run(Record {
            file: 0,
            offset: 10,
            size: 10,
            crc: Some(ok ^ 1)
        })
        .is_none()); // corrupt
        assert!(run(Record {
            file: 0,
            offset: 995,
            size: 10,
            crc: None
        })
        .is_none()); // file ends inside
        assert!(run(Record {
            file: 1,
            offset: 0,
            size: 1,
            crc: None
        })
        .is_none()); // no such source
        assert!(run(Record {
            file: 0,
            offset: u64::MAX,
            size: 2,
            crc: None
        })
        .is_none());
        assert!(run(Record {
            file: 0,
            offset: 0,
            size: MAX_BYTES + 1,
            crc: None
        })
        .is_none());
        assert!(records_of(&[0; 4], &[0; 8], &[0; 8], &(-2i64).to_le_bytes()).is_none());
        assert!(records_of(&[0; 4], &(-1i64).to_le_bytes(), &[0; 8], &[0; 8]).is_none());
        assert!(records_of(&[0; 4], &[0; 8], &[0; 8], &[0; 7]).is_none());
    }
}
