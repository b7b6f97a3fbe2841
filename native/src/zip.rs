//! The zip container's directory, read with the checks of `ckptfix/fileio/ziparchive.py`'s
//! `read_directory` (the reference): end records, zip64 locator and record, every central
//! directory entry, names, case-insensitive clashes, methods, flags, sizes, local headers and
//! overlaps -- in the same order, with the same messages (less the `path: ` prefix Python adds).
//!
//! Anything the Python engine does that this one would have to imitate at length is left to it
//! (`Ok(None)`: the Python engine then reads the whole directory, same result by construction):
//! a name that is not ASCII, once it is reached (Python's UTF-8 decoding, `str.casefold` and
//! `repr` of non-ASCII text), a read error
//! or a read shorter than a struct (Python raises `OSError` / `struct.error` there).
//!
//! The result is columns (see [`Directory::encode`]): one names blob and packed arrays that
//! `ZipDirectory` adopts without building a Python object per record.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// The zip record signatures (APPNOTE 4.3), shared with the writer (`zipwrite.rs`).
pub(crate) const LOCAL_SIG: &[u8; 4] = b"PK\x03\x04";
pub(crate) const CENTRAL_SIG: &[u8; 4] = b"PK\x01\x02";
pub(crate) const EOCD_SIG: &[u8; 4] = b"PK\x05\x06";
pub(crate) const EOCD64_SIG: &[u8; 4] = b"PK\x06\x06";
pub(crate) const EOCD64_LOCATOR_SIG: &[u8; 4] = b"PK\x06\x07";
pub(crate) const U32_MAX: u64 = 0xFFFF_FFFF;
const U16_MAX: u64 = 0xFFFF;
const LOCAL_HEADER: usize = 30;
const CENTRAL_HEADER: usize = 46;
const EOCD: usize = 22;
const EOCD64: usize = 56;
const EOCD64_LOCATOR: usize = 20;
const STORED: u16 = 0;
const DEFLATED: u16 = 8;
/// ziparchive.MAX_DEFLATE_RATIO
const MAX_DEFLATE_RATIO: u128 = 1032;
const ENCRYPTED_FLAGS: u16 = 0x0001 | 0x0040 | 0x2000;
const DATA_DESCRIPTOR_FLAG: u16 = 0x0008;
const ZIP64_EXTRA: u16 = 0x0001;
/// ranges.WindowedReader's window
const WINDOW: usize = 1 << 16;
/// the most a descriptor read asks the kernel for at once
#[cfg(unix)]
const CHUNK: usize = 1 << 22;

/// Positioned reads of the archive: a short result only where the bytes end; `Err` for an I/O
/// error (`None`: left to the Python engine, which raises it as `OSError`).
pub trait Source {
    fn read_at(&self, offset: u64, len: usize) -> Option<Vec<u8>>;
}

/// An archive in memory (tests and fuzzing).
impl Source for [u8] {
    fn read_at(&self, offset: u64, len: usize) -> Option<Vec<u8>> {
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(self.len());
        let end = start.saturating_add(len).min(self.len());
        Some(self[start..end].to_vec())
    }
}

/// Why the native engine stops: a refusal (the message) or "leave it to the Python engine".
#[derive(Debug, PartialEq, Eq)]
pub enum Stop {
    Bad(String),
    Python,
}

type Res<T> = Result<T, Stop>;

fn bad<T>(message: String) -> Res<T> {
    Err(Stop::Bad(message))
}

use crate::le::{u16_at, u32_at, u64_at};

/// Python's `repr()` of an ASCII `str` (the names in messages; non-ASCII never gets here).
pub fn py_repr(s: &[u8]) -> String {
    let quote = if s.contains(&b'\'') && !s.contains(&b'"') {
        b'"'
    } else {
        b'\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote as char);
    for &c in s {
        match c {
            b'\\' => out.push_str("\\\\"),
            b'\t' => out.push_str("\\t"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            _ if c == quote => {
                out.push('\\');
                out.push(c as char);
            }
            0x20..=0x7e => out.push(c as char),
            _ => out.push_str(&format!("\\x{c:02x}")),
        }
    }
    out.push(quote as char);
    out
}

/// `_shown(raw)`, `repr(raw.decode("utf-8", "backslashreplace"))`: a name for a message. Bytes
/// that are not UTF-8 become `\xNN` text; a valid non-ASCII character is left to the Python
/// engine (its `repr` keeps printable ones as they are, by Unicode's tables).
fn shown(raw: &[u8]) -> Res<String> {
    let mut text = Vec::with_capacity(raw.len());
    for chunk in raw.utf8_chunks() {
        if !chunk.valid().is_ascii() {
            return Err(Stop::Python);
        }
        text.extend_from_slice(chunk.valid().as_bytes());
        for byte in chunk.invalid() {
            text.extend_from_slice(format!("\\x{byte:02x}").as_bytes());
        }
    }
    Ok(py_repr(&text))
}

/// `WindowedReader`: small reads in mostly increasing order served from one window.
struct Window<'a, S: Source + ?Sized> {
    source: &'a S,
    start: u64,
    buffer: Vec<u8>,
}

impl<'a, S: Source + ?Sized> Window<'a, S> {
    fn new(source: &'a S) -> Self {
        Window {
            source,
            start: 0,
            buffer: Vec::new(),
        }
    }

    /// The bytes at `[offset, offset + size)`, short where the file ends.
    fn read(&mut self, offset: u64, size: usize) -> Res<&[u8]> {
        if size == 0 {
            return Ok(&[]);
        }
        if let Some(at) = offset.checked_sub(self.start) {
            if let Ok(at) = usize::try_from(at) {
                if at
                    .checked_add(size)
                    .is_some_and(|end| end <= self.buffer.len())
                {
                    return Ok(&self.buffer[at..at + size]);
                }
            }
        }
        let want = size.max(WINDOW);
        self.buffer = self.source.read_at(offset, want).ok_or(Stop::Python)?;
        self.start = offset;
        let end = size.min(self.buffer.len());
        Ok(&self.buffer[..end])
    }
}

/// Where the central directory is (zip64 values applied).
#[derive(Debug, PartialEq, Eq)]
struct End {
    count: u64,
    cd_offset: u64,
    cd_size: u64,
}

fn read_end<S: Source + ?Sized>(f: &S, file_size: u64) -> Res<End> {
    let tail_len = file_size.min(EOCD as u64 + U16_MAX);
    let tail_at = file_size - tail_len;
    let tail = f.read_at(tail_at, tail_len as usize).ok_or(Stop::Python)?;
    let pos = tail.windows(4).rposition(|w| w == EOCD_SIG);
    let pos = match pos {
        Some(pos) if pos + EOCD <= tail.len() => pos,
        _ => {
            return bad(
                "the zip directory at the end of the file is missing: the file is \
                        truncated (an interrupted download or copy?)"
                    .into(),
            )
        }
    };
    let disk = u16_at(&tail, pos + 4);
    let cd_disk = u16_at(&tail, pos + 6);
    let disk_count = u16_at(&tail, pos + 8);
    let count = u16_at(&tail, pos + 10) as u64;
    let cd_size = u32_at(&tail, pos + 12) as u64;
    let cd_offset = u32_at(&tail, pos + 16) as u64;
    let eocd_at = tail_at + pos as u64;
    if disk != 0 || cd_disk != 0 || disk_count as u64 != count {
        return bad("a multi-disk (split) zip archive; join its parts first".into());
    }
    let (mut count, mut cd_size, mut cd_offset) = (count, cd_size, cd_offset);
    let directory_end;
    match read_zip64_end(f, eocd_at)? {
        None => {
            if count == U16_MAX || cd_size == U32_MAX || cd_offset == U32_MAX {
                return bad("corrupt zip64 directory (its locator is missing)".into());
            }
            directory_end = eocd_at;
        }
        Some((wide, at)) => {
            for (classic, value, sentinel) in [
                (count, wide.count, U16_MAX),
                (cd_size, wide.cd_size, U32_MAX),
                (cd_offset, wide.cd_offset, U32_MAX),
            ] {
                if classic != sentinel && classic != value {
                    return bad(
                        "the zip64 end record and the classic one describe different directories \
                                (zip readers would disagree on the records); refusing"
                            .into(),
                    );
                }
            }
            (count, cd_size, cd_offset) = (wide.count, wide.cd_size, wide.cd_offset);
            directory_end = at;
        }
    }
    let cd_end = cd_offset as u128 + cd_size as u128;
    if cd_end > directory_end as u128 {
        return bad("corrupt zip directory (offsets point outside the file)".into());
    }
    if count as u128 * CENTRAL_HEADER as u128 > cd_size as u128 {
        return bad(format!(
            "corrupt zip directory ({count} entries cannot fit in its {cd_size} bytes)"
        ));
    }
    if cd_end != directory_end as u128 {
        return bad(format!(
            "{} bytes the zip directory does not account for (data before the archive or between its \
             directory and end record: zip readers disagree on where its records are); refusing",
            directory_end as u128 - cd_end
        ));
    }
    Ok(End {
        count,
        cd_offset,
        cd_size,
    })
}

/// The zip64 end record's values and offset, or None when there is no locator right before
/// the classic end record.
fn read_zip64_end<S: Source + ?Sized>(f: &S, eocd_at: u64) -> Res<Option<(End, u64)>> {
    let Some(loc_at) = eocd_at.checked_sub(EOCD64_LOCATOR as u64) else {
        return Ok(None);
    };
    let loc = f.read_at(loc_at, EOCD64_LOCATOR).ok_or(Stop::Python)?;
    if loc.len() != EOCD64_LOCATOR {
        return Err(Stop::Python); // struct.error in Python
    }
    if &loc[..4] != EOCD64_LOCATOR_SIG {
        return Ok(None);
    }
    let locator_disk = u32_at(&loc, 4);
    let eocd64_at = u64_at(&loc, 8);
    if locator_disk != 0 || Some(eocd64_at) != loc_at.checked_sub(EOCD64 as u64) {
        return bad("corrupt zip64 directory locator".into());
    }
    let rec = f.read_at(eocd64_at, EOCD64).ok_or(Stop::Python)?;
    if rec.len() != EOCD64 {
        return Err(Stop::Python);
    }
    if &rec[..4] != EOCD64_SIG {
        return bad("corrupt zip64 end record".into());
    }
    let (disk, cd_disk) = (u32_at(&rec, 16), u32_at(&rec, 20));
    let (count_disk, count) = (u64_at(&rec, 24), u64_at(&rec, 32));
    if disk != 0 || cd_disk != 0 || count_disk != count {
        return bad("a multi-disk (split) zip archive; join its parts first".into());
    }
    Ok(Some((
        End {
            count,
            cd_size: u64_at(&rec, 40),
            cd_offset: u64_at(&rec, 48),
        },
        eocd64_at,
    )))
}

/// One central directory entry (zip64 values applied); the name is a range of the directory.
struct DirEntry {
    name: (usize, usize),
    flags: u16,
    method: u16,
    crc: u32,
    compressed_size: u64,
    size: u64,
    header_offset: u64,
}

/// `_extra_fields` then the zip64 field: replace the 0xFFFFFFFF placeholders in order.
fn apply_zip64_extra(extra: &[u8], values: [u64; 3], raw_name: &[u8]) -> Res<[u64; 3]> {
    let placeholders = values.map(|v| v == U32_MAX);
    if extra.is_empty() && !placeholders.iter().any(|&p| p) {
        return Ok(values);
    }
    let mut wide: Option<&[u8]> = None;
    let mut at = 0usize;
    while at < extra.len() {
        if at + 4 > extra.len() {
            return bad(format!(
                "record {} has a corrupt extra field",
                shown(raw_name)?
            ));
        }
        let tag = u16_at(extra, at);
        let size = u16_at(extra, at + 2) as usize;
        if at + 4 + size > extra.len() {
            return bad(format!(
                "record {} has a corrupt extra field",
                shown(raw_name)?
            ));
        }
        if tag == ZIP64_EXTRA && wide.is_none() {
            wide = Some(&extra[at + 4..at + 4 + size]);
        }
        at += 4 + size;
    }
    let wide = wide.unwrap_or(&[]);
    let mut given = wide.chunks_exact(8).map(|c| u64_at(c, 0));
    let wanted = placeholders.iter().filter(|&&p| p).count();
    if wide.len() / 8 < wanted {
        return bad(format!(
            "record {} lacks the zip64 sizes its directory entry announces",
            shown(raw_name)?
        ));
    }
    let mut out = values;
    for (value, placeholder) in out.iter_mut().zip(placeholders) {
        if placeholder {
            *value = given.next().unwrap_or(0);
        }
    }
    Ok(out)
}

fn parse_central_directory(directory: &[u8], count: u64) -> Res<Vec<DirEntry>> {
    let end = directory.len();
    // count * 46 <= cd_size was checked, and a short read only makes the loop stop sooner
    let mut entries = Vec::with_capacity((count as usize).min(end / CENTRAL_HEADER));
    let mut at = 0usize;
    for _ in 0..count {
        if at + CENTRAL_HEADER > end || &directory[at..at + 4] != CENTRAL_SIG {
            return bad("corrupt zip directory entry".into());
        }
        let h = &directory[at..at + CENTRAL_HEADER];
        let flags = u16_at(h, 8);
        let method = u16_at(h, 10);
        let crc = u32_at(h, 16);
        let csize = u32_at(h, 20) as u64;
        let usize_ = u32_at(h, 24) as u64;
        let name_len = u16_at(h, 28) as usize;
        let extra_len = u16_at(h, 30) as usize;
        let comment_len = u16_at(h, 32) as usize;
        let header_offset = u32_at(h, 42) as u64;
        let name_at = at + CENTRAL_HEADER;
        at = name_at + name_len + extra_len + comment_len;
        if at > end {
            return bad("corrupt zip directory entry (it runs past the directory)".into());
        }
        let raw_name = &directory[name_at..name_at + name_len];
        let mut values = [usize_, csize, header_offset];
        if extra_len != 0 || values.contains(&U32_MAX) {
            let extra = &directory[name_at + name_len..name_at + name_len + extra_len];
            values = apply_zip64_extra(extra, values, raw_name)?;
        }
        entries.push(DirEntry {
            name: (name_at, name_at + name_len),
            flags,
            method,
            crc,
            compressed_size: values[1],
            size: values[0],
            header_offset: values[2],
        });
    }
    if at != end {
        return bad(format!(
            "the zip directory holds more than the {count} entries its end record declares \
             (zip readers would disagree on the records); refusing"
        ));
    }
    Ok(entries)
}

/// `_PLAIN_NAME.fullmatch(raw) and b".." not in raw`, in one pass.
fn plain_name(raw: &[u8]) -> bool {
    let Some((&first, _)) = raw.split_first() else {
        return false;
    };
    if first == b'/' {
        return false;
    }
    let mut previous = 0u8;
    for &c in raw {
        if !(c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-' | b'/'))
            || (c == b'.' && previous == b'.')
        {
            return false;
        }
        previous = c;
    }
    true
}

/// `_checked_name` for an ASCII name.
fn check_name(raw: &[u8]) -> Res<()> {
    if plain_name(raw) {
        return Ok(());
    }
    if raw.is_empty() {
        return bad("a record with an empty name; refusing".into());
    }
    if raw.contains(&0) {
        return bad(format!(
            "record name {} holds a NUL byte; refusing",
            py_repr(raw)
        ));
    }
    let parts: Vec<&[u8]> = raw.split(|&c| c == b'/' || c == b'\\').collect();
    if parts[0].is_empty() || parts[0].contains(&b':') {
        return bad(format!(
            "record name {} is an absolute path; refusing",
            py_repr(raw)
        ));
    }
    if parts.iter().any(|p| *p == b"..") {
        return bad(format!(
            "record name {} climbs out of the archive with '..'; refusing",
            py_repr(raw)
        ));
    }
    Ok(())
}

/// An ASCII name compared and hashed ignoring case (`str.casefold` on ASCII).
struct Caseless<'a>(&'a [u8]);

impl PartialEq for Caseless<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.0.eq_ignore_ascii_case(other.0)
    }
}

impl Eq for Caseless<'_> {}

impl Hash for Caseless<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // lowered a chunk at a time: one hasher write per chunk, not per byte
        state.write_usize(self.0.len());
        let mut lowered = [0u8; 64];
        for chunk in self.0.chunks(lowered.len()) {
            let part = &mut lowered[..chunk.len()];
            part.copy_from_slice(chunk);
            part.make_ascii_lowercase();
            state.write(part);
        }
    }
}

/// [`refuse_name_clashes`] with one hash map of every name: the reference of the sorted pass, and
/// what runs where many names share one hash (names that are the same ignoring case).
fn refuse_name_clashes_map<'a>(names: impl Iterator<Item = &'a [u8]>, capacity: usize) -> Res<()> {
    let mut seen: HashMap<Caseless<'a>, &'a [u8]> = HashMap::with_capacity(capacity);
    for name in names {
        let other = match seen.entry(Caseless(name)) {
            Entry::Vacant(slot) => {
                slot.insert(name);
                continue;
            }
            Entry::Occupied(slot) => *slot.get(),
        };
        return clash(other, name);
    }
    Ok(())
}

/// The reference's message for the first clash: `name` is the first record (in directory order)
/// whose name an earlier record's `other` already has, ignoring case.
fn clash<T>(other: &[u8], name: &[u8]) -> Res<T> {
    if other == name {
        return bad(format!(
            "the zip holds two records named {}; refusing",
            py_repr(name)
        ));
    }
    bad(format!(
        "records {} and {} differ only in case; torch's zip reader ignores case and could load \
         the one ckptfix did not check; refusing",
        py_repr(other),
        py_repr(name)
    ))
}

/// Names that share a hash, compared pairwise at most this many: more goes to the map.
const MAX_RUN: usize = 32;

/// `_refuse_name_clashes`: no two names equal ignoring (ASCII) case; the first clash in
/// directory order is refused, named as the reference names it (the earlier record first).
///
/// Sorted, not one hash map of every name: a map of 1 M names misses the caches on every insert
/// (0.72 s of the 1 M-record directory's 0.87 s of CPU, bench/RESULTS.md "Native core, slice 3:
/// reader"). Here each name's keyed hash (std's `RandomState`: no input can aim at collisions)
/// goes into one array with its row, sorted; only rows of equal hash are compared. A run of
/// more than [`MAX_RUN`] equal hashes (names that are the same ignoring case) is left to the map.
fn refuse_name_clashes(names: &[&[u8]]) -> Res<()> {
    let state = std::collections::hash_map::RandomState::new();
    let mut keyed: Vec<(u64, u32)> = Vec::with_capacity(names.len());
    for (row, name) in names.iter().enumerate() {
        let Ok(row) = u32::try_from(row) else {
            return refuse_name_clashes_map(names.iter().copied(), names.len());
        };
        keyed.push((
            std::hash::BuildHasher::hash_one(&state, Caseless(name)),
            row,
        ));
    }
    keyed.sort_unstable();
    // the clash the reference meets first: the one whose later row is smallest
    let mut first: Option<(u32, u32)> = None;
    for run in keyed.chunk_by(|a, b| a.0 == b.0) {
        if run.len() < 2 {
            continue;
        }
        if run.len() > MAX_RUN {
            return refuse_name_clashes_map(names.iter().copied(), names.len());
        }
        // rows ascend within a run (sorted by (hash, row)); the earliest equal row is the one
        // the reference's map holds
        for (j, &(_, later)) in run.iter().enumerate().skip(1) {
            let name = Caseless(names[later as usize]);
            if let Some(&(_, earlier)) = run[..j]
                .iter()
                .find(|&&(_, e)| Caseless(names[e as usize]) == name)
            {
                if first.is_none_or(|(_, l)| later < l) {
                    first = Some((earlier, later));
                }
                break;
            }
        }
    }
    match first {
        Some((earlier, later)) => clash(names[earlier as usize], names[later as usize]),
        None => Ok(()),
    }
}

fn check_entry(entry: &DirEntry, name: &[u8]) -> Res<()> {
    if entry.flags & ENCRYPTED_FLAGS != 0 {
        return bad(format!("record {} is encrypted", py_repr(name)));
    }
    if entry.method != STORED && entry.method != DEFLATED {
        return bad(format!(
            "record {} uses zip compression method {}",
            py_repr(name),
            entry.method
        ));
    }
    if entry.method == STORED && entry.compressed_size != entry.size {
        return bad(format!("record {} has inconsistent sizes", py_repr(name)));
    }
    if entry.method == DEFLATED
        && entry.size as u128 > entry.compressed_size as u128 * MAX_DEFLATE_RATIO
    {
        return bad(format!(
            "record {} claims to inflate {} bytes to {}, more than deflate can ({MAX_DEFLATE_RATIO}x): a zip \
             bomb or a corrupt size; refusing",
            py_repr(name),
            entry.compressed_size,
            entry.size
        ));
    }
    Ok(())
}

/// `_check_local_header`: where the record's data starts.
fn check_local_header<S: Source + ?Sized>(
    view: &mut Window<'_, S>,
    entry: &DirEntry,
    name: &[u8],
    file_size: u64,
) -> Res<u64> {
    let outside = || {
        bad(format!(
            "record {} lies outside the file: truncated or corrupt",
            py_repr(name)
        ))
    };
    if entry.header_offset as u128 + LOCAL_HEADER as u128 > file_size as u128 {
        return outside();
    }
    let head = view.read(entry.header_offset, LOCAL_HEADER + name.len())?;
    if head.len() < LOCAL_HEADER {
        return Err(Stop::Python); // struct.error in Python (the file is shorter than its size)
    }
    if &head[..4] != LOCAL_SIG {
        return bad(format!(
            "record {} has no valid local header: corrupt zip",
            py_repr(name)
        ));
    }
    let flags = u16_at(head, 6);
    let method = u16_at(head, 8);
    let crc = u32_at(head, 14);
    let csize = u32_at(head, 18) as u64;
    let usize_ = u32_at(head, 22) as u64;
    let name_len = u16_at(head, 26) as usize;
    let extra_len = u16_at(head, 28) as usize;
    let names_match = name_len == name.len() && &head[LOCAL_HEADER..] == name;
    // header_offset + 30 <= file_size < 2^64, plus two u16s: no overflow in u64
    let data_offset = entry.header_offset + (LOCAL_HEADER + name_len + extra_len) as u64;
    if data_offset > file_size {
        return outside();
    }
    if !names_match {
        let local_name = view.read(entry.header_offset + LOCAL_HEADER as u64, name_len)?;
        return bad(format!(
            "record {} is named {} in its local header; zip readers would disagree on what it is; refusing",
            py_repr(name),
            shown(local_name)?
        ));
    }
    if method != entry.method {
        return bad(format!(
            "record {} has compression method {method} in its local header but {} in the zip directory; refusing",
            py_repr(name),
            entry.method
        ));
    }
    if flags & DATA_DESCRIPTOR_FLAG == 0 {
        let (mut csize, mut usize_) = (csize, usize_);
        if csize == U32_MAX || usize_ == U32_MAX {
            let extra = view
                .read(
                    entry.header_offset + (LOCAL_HEADER + name_len) as u64,
                    extra_len,
                )?
                .to_vec();
            let values = apply_zip64_extra(&extra, [usize_, csize, 0], name)?;
            (usize_, csize) = (values[0], values[1]);
        }
        if (crc, csize, usize_) != (entry.crc, entry.compressed_size, entry.size) {
            return bad(format!(
                "record {} has other sizes or CRC in its local header than in the zip directory; refusing",
                py_repr(name)
            ));
        }
    }
    Ok(data_offset)
}

/// The records, in directory order, as columns.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Directory {
    pub names: Vec<u8>,
    pub name_ends: Vec<usize>,
    pub data_offset: Vec<u64>,
    pub compressed_size: Vec<u64>,
    pub size: Vec<u64>,
    pub header_offset: Vec<u64>,
    pub crc: Vec<u32>,
    pub method: Vec<u8>,
}

impl Directory {
    pub fn len(&self) -> usize {
        self.name_ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.name_ends.is_empty()
    }

    pub fn name(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.name_ends[i - 1] + 1 };
        &self.names[start..self.name_ends[i]]
    }

    /// `u64 n`, then `i64 data_offset[n]`, `compressed_size[n]`, `size[n]`, `header_offset[n]`
    /// (each below 2^63: bounded by the file size), `u32 crc[n]`, `u8 method[n]`, then the
    /// names joined by NUL (no name holds one: they are refused).
    pub fn encode(&self) -> Vec<u8> {
        let n = self.len();
        let mut out = Vec::with_capacity(8 + n * 37 + self.names.len());
        out.extend_from_slice(&(n as u64).to_le_bytes());
        for column in [
            &self.data_offset,
            &self.compressed_size,
            &self.size,
            &self.header_offset,
        ] {
            for v in column.iter() {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        for v in &self.crc {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.method);
        out.extend_from_slice(&self.names);
        out
    }
}

/// `read_directory`: the archive's records, or why not.
pub fn read_directory<S: Source + ?Sized>(f: &S, file_size: u64) -> Res<Directory> {
    let end = read_end(f, file_size)?;
    // cd_offset + cd_size <= the end record's offset < file_size (checked), and reads grow with
    // the bytes really there
    let directory = f
        .read_at(end.cd_offset, end.cd_size as usize)
        .ok_or(Stop::Python)?;
    let entries = parse_central_directory(&directory, end.count)?;
    let name_of = |e: &DirEntry| &directory[e.name.0..e.name.1];
    for entry in &entries {
        let name = name_of(entry);
        if !name.is_ascii() {
            if std::str::from_utf8(name).is_err() {
                return bad(format!(
                    "record name {} is not valid UTF-8; refusing",
                    shown(name)?
                ));
            }
            // casefold and repr of non-ASCII names: the Python engine's (names are checked
            // in order, so every refusal before this one is the same)
            return Err(Stop::Python);
        }
        check_name(name)?;
    }
    refuse_name_clashes(&entries.iter().map(name_of).collect::<Vec<_>>())?;
    let n = entries.len();
    let mut out = Directory {
        names: Vec::with_capacity(directory.len()),
        name_ends: Vec::with_capacity(n),
        data_offset: Vec::with_capacity(n),
        compressed_size: Vec::with_capacity(n),
        size: Vec::with_capacity(n),
        header_offset: Vec::with_capacity(n),
        crc: Vec::with_capacity(n),
        method: Vec::with_capacity(n),
    };
    let mut view = Window::new(f);
    for entry in &entries {
        let name = name_of(entry);
        check_entry(entry, name)?;
        let data_offset = check_local_header(&mut view, entry, name, file_size)?;
        if data_offset as u128 + entry.compressed_size as u128 > end.cd_offset as u128 {
            return bad(format!(
                "record {} extends past the end of its data: the file is truncated or corrupt",
                py_repr(name)
            ));
        }
        if !out.name_ends.is_empty() {
            out.names.push(0);
        }
        out.names.extend_from_slice(name);
        out.name_ends.push(out.names.len());
        out.data_offset.push(data_offset);
        out.compressed_size.push(entry.compressed_size);
        out.size.push(entry.size);
        out.header_offset.push(entry.header_offset);
        out.crc.push(entry.crc);
        out.method.push(entry.method as u8); // 0 or 8: checked above
    }
    refuse_overlaps(&out)?;
    Ok(out)
}

/// `_refuse_overlaps`: sorted by (start, end, name), each span starts at or after the previous
/// one's end.
fn refuse_overlaps(d: &Directory) -> Res<()> {
    let mut spans: Vec<(u64, u64, usize)> = (0..d.len())
        .map(|i| {
            (
                d.header_offset[i],
                d.data_offset[i] + d.compressed_size[i],
                i,
            )
        })
        .collect();
    spans.sort_unstable_by(|a, b| (a.0, a.1, d.name(a.2)).cmp(&(b.0, b.1, d.name(b.2))));
    for pair in spans.windows(2) {
        let (previous, span) = (pair[0], pair[1]);
        if span.0 < previous.1 {
            return bad(format!(
                "records {} and {} overlap in the file (a zip bomb or an archive that reads differently in \
                 different tools); refusing",
                py_repr(d.name(previous.2)),
                py_repr(d.name(span.2))
            ));
        }
    }
    Ok(())
}

/// An open file descriptor, or the part of it from `base` to `base + limit` (a zip stored
/// inside another file): reads are `pread`s, short where the file (or the part) ends.
#[cfg(unix)]
pub struct FdSource {
    pub file: std::mem::ManuallyDrop<std::fs::File>,
    pub base: u64,
    pub limit: Option<u64>,
}

#[cfg(unix)]
impl Source for FdSource {
    fn read_at(&self, offset: u64, len: usize) -> Option<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let len = match self.limit {
            Some(limit) => {
                len.min(usize::try_from(limit.saturating_sub(offset)).unwrap_or(usize::MAX))
            }
            None => len,
        };
        let at = self.base.checked_add(offset)?;
        // grown by what the file really holds, a chunk at a time: `len` is the caller's size
        // (a FileSlice's from a container's metadata), not a number to allocate up front
        let mut buffer = Vec::with_capacity(len.min(CHUNK));
        let mut chunk = vec![0u8; len.min(CHUNK)];
        while buffer.len() < len {
            let want = (len - buffer.len()).min(CHUNK);
            match self
                .file
                .read_at(&mut chunk[..want], at.checked_add(buffer.len() as u64)?)
            {
                Ok(0) => break,
                Ok(k) => buffer.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        Some(buffer)
    }
}

/// Read the directory of the zip in file descriptor `fd` (borrowed, not closed), from `base`
/// on, `size` bytes long; `limit` < 0: reads may go to the end of the file, else they stop at
/// `limit` bytes past `base` (`FileSlice`). Output: [`Directory::encode`].
///
/// # Safety
/// `fd` must be an open file descriptor for the duration of the call; `out` as [`crate::ffi::guard`].
#[no_mangle]
pub unsafe extern "C" fn ckptfix_zip_read_directory(
    fd: i32,
    base: u64,
    size: u64,
    limit: i64,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    let body = move || -> Result<Option<Vec<u8>>, String> {
        #[cfg(unix)]
        {
            use std::os::fd::FromRawFd;
            if fd < 0 {
                return Ok(None);
            }
            // SAFETY: the caller keeps `fd` open for the call; ManuallyDrop never closes it.
            let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
            let source = FdSource {
                file,
                base,
                limit: u64::try_from(limit).ok(),
            };
            finish(read_directory(&source, size))
        }
        #[cfg(not(unix))]
        {
            let _ = (fd, base, size, limit);
            Ok(None)
        }
    };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe { crate::ffi::guard(out, body) }
}

/// Read the directory of the zip held in memory at `(ptr, len)`: tests and fuzzing.
///
/// # Safety
/// `(ptr, len)` as [`crate::ffi::input`]; `out` as [`crate::ffi::guard`].
#[no_mangle]
pub unsafe extern "C" fn ckptfix_zip_read_directory_bytes(
    ptr: *const u8,
    len: usize,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract.
    let data = unsafe { crate::ffi::input(ptr, len) };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe { crate::ffi::guard(out, || finish(read_directory(data, data.len() as u64))) }
}

fn finish(result: Res<Directory>) -> Result<Option<Vec<u8>>, String> {
    match result {
        Ok(directory) => Ok(Some(directory.encode())),
        Err(Stop::Bad(message)) => Err(message),
        Err(Stop::Python) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zipwrite::{central_directory, small_records, Items};

    /// An archive of `names` (as ZipWriter lays it out), each record's data its name.
    fn archive(names: &[&str], threshold: u64) -> Vec<u8> {
        let full: Vec<u8> = names.iter().flat_map(|n| n.bytes()).collect();
        let ends: Vec<u64> = names
            .iter()
            .scan(0u64, |at, n| {
                *at += n.len() as u64;
                Some(*at)
            })
            .collect();
        let items = Items::new(&full, &ends).unwrap();
        let crcs = vec![7u32; names.len()];
        let mut out = small_records(&items, &items, &crcs, 0, threshold).unwrap();
        let offsets: Vec<u64> = out
            .split_off(out.len() - 8 * names.len())
            .chunks_exact(8)
            .map(|c| u64_at(c, 0))
            .collect();
        let sizes: Vec<u64> = names.iter().map(|n| n.len() as u64).collect();
        let cd_offset = out.len() as u64;
        out.extend(
            central_directory(&items, &offsets, &sizes, &crcs, cd_offset, threshold).unwrap(),
        );
        out
    }

    fn refusal(data: &[u8]) -> String {
        match read_directory(data, data.len() as u64) {
            Err(Stop::Bad(message)) => message,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn reads_back_what_the_writer_lays_out_with_and_without_zip64() {
        for threshold in [u64::from(u32::MAX), 100, 1] {
            let data = archive(&["a/data.pkl", "a/data/0", "a/version"], threshold);
            let directory = read_directory(&data[..], data.len() as u64).unwrap();
            assert_eq!(directory.len(), 3);
            assert_eq!(directory.name(1), b"a/data/0");
            assert_eq!(directory.size, vec![10, 8, 9]);
            assert!(directory.data_offset.iter().all(|o| o % 64 == 0));
            assert_eq!(
                &data[directory.data_offset[2] as usize..][..9],
                b"a/version"
            );
        }
    }

    #[test]
    fn refuses_what_the_reference_refuses() {
        let data = archive(&["a/x", "a/X"], u64::from(u32::MAX));
        assert!(refusal(&data).starts_with("records 'a/x' and 'a/X' differ only in case"));
        let data = archive(&["a/../x"], u64::from(u32::MAX));
        assert!(refusal(&data).contains("climbs out of the archive"));
        let data = archive(&["a/x"], u64::from(u32::MAX));
        assert!(refusal(&data[..data.len() - 1])
            .contains("the zip directory at the end of the file is missing"));
        let mut other = data.clone();
        other[8] = 8; // the local header's method
        assert!(refusal(&other)
            .contains("compression method 8 in its local header but 0 in the zip directory"));
        let mut encrypted = data.clone();
        encrypted[6] |= 1; // in the local header only: the directory's flags decide
        assert!(read_directory(&encrypted[..], encrypted.len() as u64).is_ok());
    }

    #[test]
    fn the_sorted_clash_check_refuses_as_the_map_does() {
        // deterministic names with clashes (exact and in other case) at random places
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut refused = 0;
        for round in 0..400 {
            let n = 1 + (next() % 60) as usize;
            let mut names: Vec<Vec<u8>> =
                (0..n).map(|i| format!("a/data/{i}").into_bytes()).collect();
            for _ in 0..(next() % 4) {
                let (from, to) = ((next() % n as u64) as usize, (next() % n as u64) as usize);
                let mut copy = names[from].clone();
                if next() % 2 == 0 {
                    copy.make_ascii_uppercase();
                }
                names[to] = copy;
            }
            if round % 50 == 0 {
                names = vec![b"x".to_vec(); n]; // one run of equal hashes past MAX_RUN
            }
            let names: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
            let map = refuse_name_clashes_map(names.iter().copied(), names.len());
            assert_eq!(refuse_name_clashes(&names), map);
            refused += usize::from(map.is_err());
        }
        assert!((50..350).contains(&refused), "{refused}");
    }

    #[test]
    fn names_in_messages_are_shown_as_python_shows_them() {
        assert_eq!(py_repr(b"a'b"), "\"a'b\"");
        assert_eq!(py_repr(b"a'\"b\\\n\x7f"), "'a\\'\"b\\\\\\n\\x7f'");
        assert_eq!(shown(b"ab\xff").unwrap(), "'ab\\\\xff'");
        assert_eq!(shown("é".as_bytes()), Err(Stop::Python));
    }
}
