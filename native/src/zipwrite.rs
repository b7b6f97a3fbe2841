//! The zip writer's per-record bytes, built from columns: what `ZipWriter` in
//! `ckptfix/fileio/ziparchive.py` (the reference) writes for a run of small records -- local
//! header, `FB` padding extra field to the next 64-byte boundary, data, data descriptor -- and
//! the central directory with the zip64 and classic end records. Byte for byte the same as the
//! Python writer (a differential test holds them to it); where the Python writer would raise
//! (a name or a value too wide for its field: `struct.error`) this returns `None` and the
//! Python writer runs, raising the same.

use crate::zip::{CENTRAL_SIG, EOCD64_LOCATOR_SIG, EOCD64_SIG, EOCD_SIG, LOCAL_SIG, U32_MAX};

const DESCRIPTOR_SIG: &[u8; 4] = b"PK\x07\x08";
const LOCAL_HEADER: u64 = 30;
const ALIGNMENT: u64 = 64;
const FLAGS: u16 = 0x0808;
/// ziparchive's `offset + size + 4096` margin: a small record near the zip64 threshold takes
/// the general path
const MARGIN: u64 = 4096;

fn u16_of(v: u64) -> Option<[u8; 2]> {
    u16::try_from(v).ok().map(u16::to_le_bytes)
}

fn u32_of(v: u64) -> Option<[u8; 4]> {
    u32::try_from(v).ok().map(u32::to_le_bytes)
}

/// Columns of variable-length items: `items[i] = blob[ends[i-1]..ends[i]]`, checked.
pub struct Items<'a> {
    blob: &'a [u8],
    ends: &'a [u64],
}

impl<'a> Items<'a> {
    pub fn new(blob: &'a [u8], ends: &'a [u64]) -> Option<Self> {
        let mut previous = 0u64;
        for &end in ends {
            if end < previous {
                return None;
            }
            previous = end;
        }
        if previous != blob.len() as u64 {
            return None;
        }
        Some(Items { blob, ends })
    }

    /// How many items there are.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The bytes of all items together.
    pub fn blob_len(&self) -> usize {
        self.blob.len()
    }

    pub(crate) fn get(&self, i: usize) -> &'a [u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.blob[start..self.ends[i] as usize]
    }
}

/// One small record at `offset`, appended to `out`: `ZipWriter.add_small`.
pub(crate) fn small_record(
    out: &mut Vec<u8>,
    offset: u64,
    full: &[u8],
    data: &[u8],
    crc: u32,
    threshold: u64,
) -> Option<()> {
    let size = data.len() as u64;
    let needs = |v: u64| v >= threshold;
    let size_wide = needs(size);
    let zip64 = size_wide || needs(offset.checked_add(size)?.checked_add(MARGIN)?);
    // _start_record: a zip64 extra field only where the values need one
    let mut extra64 = Vec::new();
    if zip64 && (size_wide || needs(offset)) {
        let mut body = Vec::new();
        if size_wide {
            body.extend_from_slice(&[0u8; 16]);
        }
        if needs(offset) {
            body.extend_from_slice(&offset.to_le_bytes());
        }
        extra64.extend_from_slice(&1u16.to_le_bytes());
        extra64.extend_from_slice(&u16_of(body.len() as u64)?);
        extra64.extend_from_slice(&body);
    }
    let start = offset
        .checked_add(LOCAL_HEADER)?
        .checked_add(full.len() as u64)?
        .checked_add(extra64.len() as u64)?
        .checked_add(4)?;
    let padding = (ALIGNMENT - start % ALIGNMENT) % ALIGNMENT;
    let extra_len = extra64.len() as u64 + 4 + padding;
    out.extend_from_slice(LOCAL_SIG);
    out.extend_from_slice(&0u16.to_le_bytes()); // version needed
    out.extend_from_slice(&FLAGS.to_le_bytes());
    out.extend_from_slice(&[0u8; 2 + 2 + 2 + 4 + 4 + 4]); // method, time, date, crc, sizes
    out.extend_from_slice(&u16_of(full.len() as u64)?);
    out.extend_from_slice(&u16_of(extra_len)?);
    out.extend_from_slice(full);
    out.extend_from_slice(&extra64);
    out.extend_from_slice(b"FB");
    out.extend_from_slice(&u16_of(padding)?);
    out.resize(out.len() + padding as usize, b'Z');
    out.extend_from_slice(data);
    // _finish_record
    out.extend_from_slice(DESCRIPTOR_SIG);
    out.extend_from_slice(&crc.to_le_bytes());
    if zip64 && (size_wide || needs(offset)) {
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
    } else {
        out.extend_from_slice(&u32_of(size)?);
        out.extend_from_slice(&u32_of(size)?);
    }
    Some(())
}

/// A run of small records written from `offset` on: their bytes, then each one's header offset
/// (`i64[n]`).
pub fn small_records(
    names: &Items<'_>,
    data: &Items<'_>,
    crcs: &[u32],
    offset: u64,
    threshold: u64,
) -> Option<Vec<u8>> {
    let n = crcs.len();
    if names.ends.len() != n || data.ends.len() != n {
        return None;
    }
    let mut out =
        Vec::with_capacity(data.blob.len() + names.blob.len() + n * (30 + 64 + 16) + 8 * n);
    let mut offsets = Vec::with_capacity(n);
    let mut at = offset;
    for (i, &crc) in crcs.iter().enumerate() {
        let before = out.len();
        small_record(&mut out, at, names.get(i), data.get(i), crc, threshold)?;
        offsets.push(at);
        at = at.checked_add((out.len() - before) as u64)?;
    }
    for o in offsets {
        out.extend_from_slice(&i64::try_from(o).ok()?.to_le_bytes());
    }
    Some(out)
}

/// The central directory of the records written (names, header offsets, sizes, CRCs), starting
/// at `cd_offset`, then the zip64 end record, its locator and the classic end record:
/// `ZipWriter.close`.
pub fn central_directory(
    names: &Items<'_>,
    header_offsets: &[u64],
    sizes: &[u64],
    crcs: &[u32],
    cd_offset: u64,
    threshold: u64,
) -> Option<Vec<u8>> {
    let n = crcs.len();
    if names.ends.len() != n || header_offsets.len() != n || sizes.len() != n {
        return None;
    }
    let needs = |v: u64| v >= threshold;
    let mut out = Vec::with_capacity(names.blob.len() + n * 46 + 98);
    for i in 0..n {
        let (name, size, header_offset) = (names.get(i), sizes[i], header_offsets[i]);
        let mut zip64 = Vec::new();
        let (mut size32, mut offset32) = (size, header_offset);
        if needs(size) {
            zip64.extend_from_slice(&size.to_le_bytes());
            zip64.extend_from_slice(&size.to_le_bytes());
            size32 = U32_MAX;
        }
        if needs(header_offset) {
            zip64.extend_from_slice(&header_offset.to_le_bytes());
            offset32 = U32_MAX;
        }
        let extra_len = if zip64.is_empty() {
            0
        } else {
            4 + zip64.len() as u64
        };
        out.extend_from_slice(CENTRAL_SIG);
        out.extend_from_slice(&[0u8; 4]); // versions made by and needed
        out.extend_from_slice(&FLAGS.to_le_bytes());
        out.extend_from_slice(&[0u8; 6]); // method (stored), time, date
        out.extend_from_slice(&crcs[i].to_le_bytes());
        out.extend_from_slice(&u32_of(size32)?);
        out.extend_from_slice(&u32_of(size32)?);
        out.extend_from_slice(&u16_of(name.len() as u64)?);
        out.extend_from_slice(&u16_of(extra_len)?);
        out.extend_from_slice(&[0u8; 2 + 2 + 2 + 4]); // comment, disk, internal and external attributes
        out.extend_from_slice(&u32_of(offset32)?);
        out.extend_from_slice(name);
        if !zip64.is_empty() {
            out.extend_from_slice(&1u16.to_le_bytes());
            out.extend_from_slice(&u16_of(zip64.len() as u64)?);
            out.extend_from_slice(&zip64);
        }
    }
    let cd_size = out.len() as u64;
    let count = n as u64;
    let eocd64_at = cd_offset.checked_add(cd_size)?;
    out.extend_from_slice(EOCD64_SIG);
    out.extend_from_slice(&44u64.to_le_bytes());
    out.extend_from_slice(&0x031Eu16.to_le_bytes());
    out.extend_from_slice(&0x2Du16.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]); // disks
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&cd_size.to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(EOCD64_LOCATOR_SIG);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&eocd64_at.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(EOCD_SIG);
    out.extend_from_slice(&[0u8; 4]); // disks
    let count16 = (count.min(0xFFFF) as u16).to_le_bytes();
    out.extend_from_slice(&count16);
    out.extend_from_slice(&count16);
    out.extend_from_slice(&(cd_size.min(U32_MAX) as u32).to_le_bytes());
    out.extend_from_slice(&(cd_offset.min(U32_MAX) as u32).to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    Some(out)
}

/// `(ptr, len)` of `count` little-endian words of type `T`, as a slice (checked alignment).
pub(crate) fn words<T: Copy>(bytes: &[u8], count: usize, from: fn(&[u8]) -> T) -> Option<Vec<T>> {
    let width = std::mem::size_of::<T>();
    if bytes.len() != count.checked_mul(width)? {
        return None;
    }
    Some(bytes.chunks_exact(width).map(from).collect())
}

pub(crate) fn u64_word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    u64::from_le_bytes(w)
}

pub(crate) fn u32_word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Small records from columns: names (`blob`, `u64 ends[n]`), data (`blob`, `u64 ends[n]`),
/// `u32 crcs[n]`, written from `offset` with zip64 from `threshold` on. Output: the records'
/// bytes, then `i64 header_offsets[n]`. Unsupported: what the Python writer would refuse.
///
/// # Safety
/// Every `(ptr, len)` as [`crate::ffi::input`]; `out` as [`crate::ffi::guard`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckptfix_zip_small_records(
    names_ptr: *const u8,
    names_len: usize,
    name_ends_ptr: *const u8,
    name_ends_len: usize,
    data_ptr: *const u8,
    data_len: usize,
    data_ends_ptr: *const u8,
    data_ends_len: usize,
    crcs_ptr: *const u8,
    crcs_len: usize,
    offset: u64,
    threshold: u64,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract: each (ptr, len) is readable for the call.
    let (names, name_ends, data, data_ends, crcs) = unsafe {
        (
            crate::ffi::input(names_ptr, names_len),
            crate::ffi::input(name_ends_ptr, name_ends_len),
            crate::ffi::input(data_ptr, data_len),
            crate::ffi::input(data_ends_ptr, data_ends_len),
            crate::ffi::input(crcs_ptr, crcs_len),
        )
    };
    let body = || -> Result<Option<Vec<u8>>, String> {
        let n = crcs.len() / 4;
        let Some(crcs) = words(crcs, n, u32_word) else {
            return Ok(None);
        };
        let Some(name_ends) = words(name_ends, n, u64_word) else {
            return Ok(None);
        };
        let Some(data_ends) = words(data_ends, n, u64_word) else {
            return Ok(None);
        };
        let (Some(names), Some(data)) =
            (Items::new(names, &name_ends), Items::new(data, &data_ends))
        else {
            return Ok(None);
        };
        Ok(small_records(&names, &data, &crcs, offset, threshold))
    };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe { crate::ffi::guard(out, body) }
}

/// The central directory and end records from columns: names (`blob`, `u64 ends[n]`),
/// `i64 header_offsets[n]`, `i64 sizes[n]`, `u32 crcs[n]`, the directory starting at
/// `cd_offset`, zip64 from `threshold` on.
///
/// # Safety
/// Every `(ptr, len)` as [`crate::ffi::input`]; `out` as [`crate::ffi::guard`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckptfix_zip_central_directory(
    names_ptr: *const u8,
    names_len: usize,
    name_ends_ptr: *const u8,
    name_ends_len: usize,
    header_offsets_ptr: *const u8,
    header_offsets_len: usize,
    sizes_ptr: *const u8,
    sizes_len: usize,
    crcs_ptr: *const u8,
    crcs_len: usize,
    cd_offset: u64,
    threshold: u64,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract: each (ptr, len) is readable for the call.
    let (names, name_ends, header_offsets, sizes, crcs) = unsafe {
        (
            crate::ffi::input(names_ptr, names_len),
            crate::ffi::input(name_ends_ptr, name_ends_len),
            crate::ffi::input(header_offsets_ptr, header_offsets_len),
            crate::ffi::input(sizes_ptr, sizes_len),
            crate::ffi::input(crcs_ptr, crcs_len),
        )
    };
    let body = || -> Result<Option<Vec<u8>>, String> {
        let n = crcs.len() / 4;
        let Some(crcs) = words(crcs, n, u32_word) else {
            return Ok(None);
        };
        let Some(name_ends) = words(name_ends, n, u64_word) else {
            return Ok(None);
        };
        let Some(header_offsets) = words(header_offsets, n, u64_word) else {
            return Ok(None);
        };
        let Some(sizes) = words(sizes, n, u64_word) else {
            return Ok(None);
        };
        let Some(names) = Items::new(names, &name_ends) else {
            return Ok(None);
        };
        Ok(central_directory(
            &names,
            &header_offsets,
            &sizes,
            &crcs,
            cd_offset,
            threshold,
        ))
    };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe { crate::ffi::guard(out, body) }
}
