//! The zip writer's sources as columns, read from the live Python objects: for each item of a
//! list of `FileRange`s (`ckptfix/fileio/ranges.py`, a slots dataclass), its file, offset,
//! size and recorded CRC, read from its slots through the C API as the emitter reads records
//! (`emit_py.rs`: a table of C API functions and slot offsets Python found on probe objects, the
//! GIL held, no Python code run). A training checkpoint's ~200 000 small storages cost a few
//! Python steps each to put into columns in Python; here they cost none.

use std::collections::HashMap;

use crate::emit::Unsupported;
use crate::emit_py::{Api, Obj, PyApi};

/// The types and slots read, filled by Python (`ckptfix/native/zipsources.py`).
#[repr(C)]
pub struct PyRanges {
    pub file_range: Obj,
    pub none: Obj,
    pub int: Obj,
    pub str_: Obj,
    pub list: Obj,
    pub ob_type: usize,
    pub path: usize,
    pub offset: usize,
    pub size: usize,
    pub crc: usize,
    pub deflated_size: usize,
    /// records of at least this many bytes are not "small" (`SMALL_COPY`)
    pub small: u64,
}

/// One source's columns: 1 for a small stored range of a file (the others are 0 throughout).
struct Row {
    kind: u8,
    file: u32,
    offset: i64,
    size: i64,
    crc: i64,
}

const OTHER: Row = Row {
    kind: 0,
    file: 0,
    offset: 0,
    size: 0,
    crc: 0,
};

fn row(
    api: &Api,
    t: &PyRanges,
    obj: Obj,
    paths: &mut HashMap<usize, u32>,
    new_paths: &mut Vec<Obj>,
) -> Result<Row, Unsupported> {
    if api.type_of(obj) != t.file_range {
        return Ok(OTHER); // a computed source, a subclass: the Python writer's
    }
    if api.slot(obj, t.deflated_size)? != t.none {
        return Ok(OTHER); // compressed: inflated by the Python writer
    }
    let exact_int = |o: Obj| -> Result<Option<i64>, Unsupported> {
        if api.type_of(o) != t.int {
            return Ok(None);
        }
        Ok(Some(api.int(o)?))
    };
    let (Some(offset), Some(size)) = (
        exact_int(api.slot(obj, t.offset)?)?,
        exact_int(api.slot(obj, t.size)?)?,
    ) else {
        return Ok(OTHER);
    };
    if offset < 0 || size < 0 || size as u64 >= t.small {
        return Ok(OTHER);
    }
    let crc_obj = api.slot(obj, t.crc)?;
    let crc = if crc_obj == t.none {
        -1
    } else {
        match exact_int(crc_obj)? {
            Some(c) if (0..=i64::from(u32::MAX)).contains(&c) => c,
            _ => return Ok(OTHER),
        }
    };
    let path = api.slot(obj, t.path)?;
    if api.type_of(path) != t.str_ {
        return Ok(OTHER);
    }
    let next = u32::try_from(new_paths.len()).map_err(|_| Unsupported)?;
    let file = *paths.entry(path as usize).or_insert_with(|| {
        new_paths.push(path);
        next
    });
    Ok(Row {
        kind: 1,
        file,
        offset,
        size,
        crc,
    })
}

/// Columns of `sources` (an exact list): `u8 kinds[n]`, `u32 files[n]`, `i64 offsets[n]`,
/// `i64 sizes[n]`, `i64 crcs[n]` (-1: none recorded); each distinct path object is appended to
/// `paths` (an exact list) in order of first use, `files[i]` its index there.
fn columns(api: &Api, t: &PyRanges, sources: Obj, paths: Obj) -> Result<Vec<u8>, Unsupported> {
    if api.type_of(sources) != t.list || api.type_of(paths) != t.list {
        return Err(Unsupported);
    }
    let mut items = Vec::new();
    api.list_items(sources, &mut items)?;
    let n = items.len();
    let mut index = HashMap::new();
    let mut new_paths = Vec::new();
    let mut rows = Vec::with_capacity(n);
    for &item in &items {
        rows.push(row(api, t, item, &mut index, &mut new_paths)?);
    }
    let mut out = Vec::with_capacity(n * 29);
    out.extend(rows.iter().map(|r| r.kind));
    for r in &rows {
        out.extend_from_slice(&r.file.to_le_bytes());
    }
    for column in [|r: &Row| r.offset, |r: &Row| r.size, |r: &Row| r.crc] {
        for r in &rows {
            out.extend_from_slice(&column(r).to_le_bytes());
        }
    }
    for path in new_paths {
        api.append(paths, path)?;
    }
    Ok(out)
}

/// The columns of a list of `FileRange`s (see [`columns`]); UNSUPPORTED leaves them to Python.
///
/// # Safety
/// Call with the GIL held (`ctypes.PyDLL`): `api` and `table` point to tables filled as
/// `ckptfix/native/zipsources.py` fills them, `sources` and `paths` are live exact lists no
/// other thread changes during the call. `out` as in `ffi::guard`.
#[no_mangle]
pub unsafe extern "C" fn ckptfix_zip_source_columns(
    api: *const PyApi,
    table: *const PyRanges,
    sources: Obj,
    paths: Obj,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract above: each table pointer is null or valid for reads.
    let tables = unsafe { (api.as_ref(), table.as_ref()) };
    let body = move || -> Result<Option<Vec<u8>>, String> {
        let (Some(api), Some(table)) = tables else {
            return Ok(None);
        };
        let Some(api) = Api::new(api, table.ob_type) else {
            return Ok(None);
        };
        if sources.is_null() || paths.is_null() {
            return Ok(None);
        }
        Ok(columns(&api, table, sources, paths).ok())
    };
    // SAFETY: `out` is the caller's out-parameter (ffi::guard's contract).
    unsafe { crate::ffi::guard(out, std::panic::AssertUnwindSafe(body)) }
}
