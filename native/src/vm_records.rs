//! The reader's storage records built here, through CPython's C API: a `StorageRef` and its
//! `FileRange` per persistent id, in torch.save's layout, without a Python call per storage.
//!
//! Why: the native VM hands the reader its persistent ids as columns, and resolving 200 000 of
//! them in Python costs two dataclass `__init__` frames per storage, a `"data/" + key` string per
//! storage and a slice of the directory's names to compare (~0.25 s of the 200 000-tensor read,
//! bench/RESULTS.md "Native core, slice 3: reader"). Here each record is allocated as
//! `object.__new__` allocates it (the type's `PyType_GenericAlloc`) and its slots are set where
//! Python found them on probe objects (ckptfix/native/records.py), as the dataclass `__init__`
//! would set them: the same types, the same field objects (the key, location, numel, storage
//! class, item size, dtype, path and byte order objects are the ones Python passed in; offsets,
//! sizes and CRCs are new ints of the same values as `array.tolist()` makes).
//!
//! Only torch.save's layout is modelled: storage `i` is record `names[start + i]`, named exactly
//! `data/<key i>`, stored (not deflated), of exactly `numel * itemsize` bytes, with a storage
//! class that has a dtype. Anything else -- a name that differs, a key used twice (the names
//! are unique, so it cannot match), a compressed record, a size mismatch, an object of an
//! unexpected type, a C API call that fails -- is [`Unsupported`] and the Python resolver runs,
//! which raises the reference's error or gives the reference's result.
//!
//! The C API is not linked: Python hands over a table of stable-ABI function addresses
//! ([`RecApi`]) and the call is made through `ctypes.PyDLL` (the GIL is held throughout). No
//! Python code runs here (no `__init__`, no `__eq__`, no `__hash__`).

use std::ffi::{c_char, c_int};

use crate::emit_py::{Obj, PyObject};

/// Addresses of the C API functions used here (all in the stable ABI), filled by Python in
/// this order (records.py's `_API_FUNCTIONS`).
#[repr(C)]
pub struct RecApi {
    pub type_generic_alloc: Option<unsafe extern "C" fn(Obj, isize) -> Obj>,
    pub long_from_long_long: Option<unsafe extern "C" fn(i64) -> Obj>,
    pub long_as_long_long_and_overflow: Option<unsafe extern "C" fn(Obj, *mut c_int) -> i64>,
    pub list_new: Option<unsafe extern "C" fn(isize) -> Obj>,
    pub list_size: Option<unsafe extern "C" fn(Obj) -> isize>,
    pub list_get_item: Option<unsafe extern "C" fn(Obj, isize) -> Obj>,
    pub list_set_item: Option<unsafe extern "C" fn(Obj, isize, Obj) -> c_int>,
    pub list_append: Option<unsafe extern "C" fn(Obj, Obj) -> c_int>,
    pub unicode_as_utf8_and_size: Option<unsafe extern "C" fn(Obj, *mut isize) -> *const c_char>,
    pub inc_ref: Option<unsafe extern "C" fn(Obj)>,
    pub dec_ref: Option<unsafe extern "C" fn(Obj)>,
    pub err_occurred: Option<unsafe extern "C" fn() -> Obj>,
    pub err_clear: Option<unsafe extern "C" fn()>,
}

/// The types, objects and slot offsets the records are built with, filled by Python (each
/// object kept alive there for the call). Offsets are bytes from an object's address, found
/// on probe instances; a slot is written only into a fresh object of its exact type.
#[repr(C)]
pub struct RecSpec {
    pub storage_type: Obj,
    pub range_type: Obj,
    pub str_type: Obj,
    pub int_type: Obj,
    pub none: Obj,
    /// the file's path (every `FileRange.path`) and byte order (every `StorageRef.byteorder`)
    pub path: Obj,
    pub order: Obj,
    pub ob_type: usize,
    /// `StorageRef`'s slots
    pub s_key: usize,
    pub s_storage_type: usize,
    pub s_location: usize,
    pub s_numel: usize,
    pub s_itemsize: usize,
    pub s_dtype: usize,
    pub s_source: usize,
    pub s_byteorder: usize,
    /// `FileRange`'s slots
    pub r_path: usize,
    pub r_offset: usize,
    pub r_size: usize,
    pub r_crc: usize,
    pub r_deflated_size: usize,
    /// added to every record's data offset (a zip inside a bigger file)
    pub base: i64,
}

/// The per-id columns (Python lists, as the VM's meta pickle gives them) and the per-class
/// tables (lists indexed by kind: the storage class `Global`, its item size (0: no dtype) and
/// dtype name).
#[repr(C)]
pub struct RecColumns {
    pub kinds: Obj,
    pub keys: Obj,
    pub locations: Obj,
    pub numels: Obj,
    pub kind_globals: Obj,
    pub kind_itemsizes: Obj,
    pub kind_dtypes: Obj,
    /// the directory's names (top folder stripped), and the row of the first storage's record
    pub names: Obj,
    pub start: usize,
}

/// Why the fast path stops: the Python resolver runs instead.
#[derive(Debug)]
pub struct Unsupported;

type R<T> = Result<T, Unsupported>;

/// The C API table with every entry present, and the calls used here.
struct Api<'a> {
    a: &'a RecApi,
    spec: &'a RecSpec,
}

/// A new reference, released when dropped unless handed on with [`Owned::into_raw`].
struct Owned<'a> {
    obj: Obj,
    api: &'a Api<'a>,
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        // SAFETY: `obj` is a new reference this guard owns (not null: checked when made).
        unsafe { (self.api.a.dec_ref.unwrap_unchecked())(self.obj) }
    }
}

impl<'a> Owned<'a> {
    fn into_raw(self) -> Obj {
        let obj = self.obj;
        std::mem::forget(self);
        obj
    }
}

impl<'a> Api<'a> {
    fn complete(a: &RecApi) -> bool {
        a.type_generic_alloc.is_some()
            && a.long_from_long_long.is_some()
            && a.long_as_long_long_and_overflow.is_some()
            && a.list_new.is_some()
            && a.list_size.is_some()
            && a.list_get_item.is_some()
            && a.list_set_item.is_some()
            && a.list_append.is_some()
            && a.unicode_as_utf8_and_size.is_some()
            && a.inc_ref.is_some()
            && a.dec_ref.is_some()
            && a.err_occurred.is_some()
            && a.err_clear.is_some()
    }

    /// A new reference as an [`Owned`], or Unsupported where the call failed (error cleared).
    fn owned(&'a self, obj: Obj) -> R<Owned<'a>> {
        if obj.is_null() {
            self.clear();
            return Err(Unsupported);
        }
        Ok(Owned { obj, api: self })
    }

    fn clear(&self) {
        // SAFETY: plain C API calls with the GIL held (the PyDLL call).
        unsafe {
            if !(self.a.err_occurred.unwrap_unchecked())().is_null() {
                (self.a.err_clear.unwrap_unchecked())();
            }
        }
    }

    fn type_of(&self, obj: Obj) -> Obj {
        // SAFETY: `obj` is a live object; `ob_type` is where every object keeps its type
        // pointer (found by Python on probes), inside the object's fixed header.
        unsafe { *((obj as *const u8).add(self.spec.ob_type) as *const Obj) }
    }

    fn list_len(&self, list: Obj) -> R<usize> {
        // SAFETY: `list` is a live object; PyList_Size checks its type (-1 and an error if not).
        let n = unsafe { (self.a.list_size.unwrap_unchecked())(list) };
        usize::try_from(n).map_err(|_| {
            self.clear();
            Unsupported
        })
    }

    /// `list[i]`, borrowed (the list keeps it alive; nothing here changes the list).
    fn item(&self, list: Obj, i: usize) -> R<Obj> {
        let i = isize::try_from(i).map_err(|_| Unsupported)?;
        // SAFETY: `list` is a live list (its length was read); out of range gives NULL + IndexError.
        let obj = unsafe { (self.a.list_get_item.unwrap_unchecked())(list, i) };
        if obj.is_null() {
            self.clear();
            return Err(Unsupported);
        }
        Ok(obj)
    }

    /// The UTF-8 bytes of an exact `str` (valid while the object lives), or Unsupported.
    fn text(&self, s: Obj) -> R<&'a [u8]> {
        if self.type_of(s) != self.spec.str_type {
            return Err(Unsupported);
        }
        let mut len: isize = 0;
        // SAFETY: `s` is a live exact str; the buffer is owned by it and lives as long as it,
        // which the caller's lists guarantee for the call.
        let p = unsafe { (self.a.unicode_as_utf8_and_size.unwrap_unchecked())(s, &mut len) };
        if p.is_null() {
            self.clear(); // a lone surrogate: the Python resolver decides
            return Err(Unsupported);
        }
        let len = usize::try_from(len).map_err(|_| Unsupported)?;
        // SAFETY: CPython returned `len` bytes at `p`, owned by `s`.
        Ok(unsafe { std::slice::from_raw_parts(p as *const u8, len) })
    }

    /// The value of an exact `int` within i64, or Unsupported.
    fn int(&self, v: Obj) -> R<i64> {
        if self.type_of(v) != self.spec.int_type {
            return Err(Unsupported);
        }
        let mut overflow: c_int = 0;
        // SAFETY: `v` is a live exact int.
        let x =
            unsafe { (self.a.long_as_long_long_and_overflow.unwrap_unchecked())(v, &mut overflow) };
        if overflow != 0 {
            return Err(Unsupported);
        }
        Ok(x)
    }

    fn new_int(&'a self, v: i64) -> R<Owned<'a>> {
        // SAFETY: plain C API call with the GIL held.
        self.owned(unsafe { (self.a.long_from_long_long.unwrap_unchecked())(v) })
    }

    /// A fresh instance of `ty` as `object.__new__` makes it: every slot NULL.
    fn alloc(&'a self, ty: Obj) -> R<Owned<'a>> {
        // SAFETY: `ty` is a live heap type (Python passed the class); GenericAlloc zeroes it.
        self.owned(unsafe { (self.a.type_generic_alloc.unwrap_unchecked())(ty, 0) })
    }

    /// Store a new reference to `value` in the slot at `offset` of `obj` (a fresh object of
    /// the type whose slot that is, its slot still NULL): what the member descriptor does.
    fn set_slot(&self, obj: &Owned<'_>, offset: usize, value: Obj) {
        // SAFETY: `value` is live; the slot at `offset` is an object pointer inside `obj`'s
        // fixed part (found by Python on a probe of this exact type), NULL since allocation,
        // so nothing is leaked by overwriting it; the slot owns the new reference.
        unsafe {
            (self.a.inc_ref.unwrap_unchecked())(value);
            *((obj.obj as *mut u8).add(offset) as *mut Obj) = value;
        }
    }

    /// As [`Api::set_slot`], handing over a reference already owned.
    fn give_slot(&self, obj: &Owned<'_>, offset: usize, value: Owned<'_>) {
        // SAFETY: as `set_slot`; the reference moves from `value` into the slot.
        unsafe {
            *((obj.obj as *mut u8).add(offset) as *mut Obj) = value.into_raw();
        }
    }
}

/// Build every storage; `Ok(sizes)` (each record's byte size, i64 little-endian) with the
/// storages' list appended to `result`, or Unsupported (nothing appended).
fn build(api: &Api<'_>, cols: &RecColumns, table: Columns<'_>, result: Obj) -> R<Vec<u8>> {
    let spec = api.spec;
    let n = api.list_len(cols.keys)?;
    if api.list_len(cols.kinds)? != n
        || api.list_len(cols.locations)? != n
        || api.list_len(cols.numels)? != n
    {
        return Err(Unsupported);
    }
    let classes = api.list_len(cols.kind_globals)?;
    if api.list_len(cols.kind_itemsizes)? != classes || api.list_len(cols.kind_dtypes)? != classes {
        return Err(Unsupported);
    }
    let end = cols.start.checked_add(n).ok_or(Unsupported)?;
    if end > api.list_len(cols.names)? || end > table.rows() {
        return Err(Unsupported);
    }
    let list = api.owned(
        // SAFETY: plain C API call with the GIL held; a list of `n` NULL items, filled below.
        unsafe {
            (api.a.list_new.unwrap_unchecked())(isize::try_from(n).map_err(|_| Unsupported)?)
        },
    )?;
    let mut sizes = Vec::with_capacity(n.saturating_mul(8));
    let mut name = Vec::new();
    for i in 0..n {
        let row = cols.start + i;
        let key = api.item(cols.keys, i)?;
        name.clear();
        name.extend_from_slice(b"data/");
        name.extend_from_slice(api.text(key)?);
        if api.text(api.item(cols.names, row)?)? != name.as_slice() {
            return Err(Unsupported); // not torch.save's layout (or a key used twice)
        }
        if table.method(row) != Some(0) {
            return Err(Unsupported); // a compressed storage: checked per record by Python
        }
        let kind = usize::try_from(api.int(api.item(cols.kinds, i)?)?).map_err(|_| Unsupported)?;
        if kind >= classes {
            return Err(Unsupported);
        }
        let itemsize_obj = api.item(cols.kind_itemsizes, kind)?;
        let itemsize = api.int(itemsize_obj)?;
        let numel_obj = api.item(cols.numels, i)?;
        let numel = api.int(numel_obj)?;
        let size = table.size(row).ok_or(Unsupported)?;
        if itemsize <= 0 || numel.checked_mul(itemsize) != Some(size) {
            return Err(Unsupported); // no dtype, or a record of another size: Python's message
        }
        let location = api.item(cols.locations, i)?;
        let dtype = api.item(cols.kind_dtypes, kind)?;
        if api.type_of(location) != spec.str_type || api.type_of(dtype) != spec.str_type {
            return Err(Unsupported);
        }
        let offset = table
            .offset(row)
            .and_then(|o| o.checked_add(spec.base))
            .ok_or(Unsupported)?;
        let crc = table.crc(row).ok_or(Unsupported)?;

        let range = api.alloc(spec.range_type)?;
        api.set_slot(&range, spec.r_path, spec.path);
        api.give_slot(&range, spec.r_offset, api.new_int(offset)?);
        api.give_slot(&range, spec.r_size, api.new_int(size)?);
        api.give_slot(&range, spec.r_crc, api.new_int(i64::from(crc))?);
        api.set_slot(&range, spec.r_deflated_size, spec.none);

        let storage = api.alloc(spec.storage_type)?;
        api.set_slot(&storage, spec.s_key, key);
        api.set_slot(
            &storage,
            spec.s_storage_type,
            api.item(cols.kind_globals, kind)?,
        );
        api.set_slot(&storage, spec.s_location, location);
        api.set_slot(&storage, spec.s_numel, numel_obj);
        api.set_slot(&storage, spec.s_itemsize, itemsize_obj);
        api.set_slot(&storage, spec.s_dtype, dtype);
        api.give_slot(&storage, spec.s_source, range);
        api.set_slot(&storage, spec.s_byteorder, spec.order);
        // SAFETY: `list` has `n` items and `i < n`; SetItem steals the reference (its slot is NULL).
        if unsafe {
            (api.a.list_set_item.unwrap_unchecked())(list.obj, i as isize, storage.into_raw())
        } != 0
        {
            api.clear();
            return Err(Unsupported);
        }
        sizes.extend_from_slice(&size.to_le_bytes());
    }
    // SAFETY: `result` is a live list (Python's); Append takes its own reference.
    if unsafe { (api.a.list_append.unwrap_unchecked())(result, list.obj) } != 0 {
        api.clear();
        return Err(Unsupported);
    }
    Ok(sizes)
}

/// The zip directory's columns (native byte order arrays from Python's `array` objects).
#[derive(Clone, Copy)]
pub struct Columns<'a> {
    pub size: &'a [u8],
    pub data_offset: &'a [u8],
    pub crc: &'a [u8],
    pub method: &'a [u8],
}

impl Columns<'_> {
    fn rows(&self) -> usize {
        let n = self.method.len();
        if self.size.len() / 8 < n || self.data_offset.len() / 8 < n || self.crc.len() / 4 < n {
            return 0;
        }
        n
    }
    fn i64_at(col: &[u8], row: usize) -> Option<i64> {
        let at = row.checked_mul(8)?;
        let b: [u8; 8] = col.get(at..at.checked_add(8)?)?.try_into().ok()?;
        Some(i64::from_ne_bytes(b))
    }
    fn size(&self, row: usize) -> Option<i64> {
        Self::i64_at(self.size, row)
    }
    fn offset(&self, row: usize) -> Option<i64> {
        Self::i64_at(self.data_offset, row)
    }
    fn crc(&self, row: usize) -> Option<u32> {
        let at = row.checked_mul(4)?;
        let b: [u8; 4] = self.crc.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(u32::from_ne_bytes(b))
    }
    fn method(&self, row: usize) -> Option<u8> {
        self.method.get(row).copied()
    }
}

/// `ckptfix_vm_storages`: every persistent id's `StorageRef` (with its `FileRange`) in
/// torch.save's layout, appended to `result` as one list; the output buffer holds each record's
/// size (i64 LE). Unsupported: the Python resolver runs (nothing was appended).
///
/// # Safety
/// Called through `ctypes.PyDLL` (GIL held). `api`, `spec` and `cols` must point to tables
/// filled as records.py fills them, every object in them live for the call, `result` a list,
/// each (pointer, length) pair valid for reads, and `out` valid for one write.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckptfix_vm_storages(
    api: *const RecApi,
    spec: *const RecSpec,
    cols: *const RecColumns,
    size: *const u8,
    size_len: usize,
    data_offset: *const u8,
    data_offset_len: usize,
    crc: *const u8,
    crc_len: usize,
    method: *const u8,
    method_len: usize,
    result: *mut PyObject,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract: the (pointer, length) pairs are valid for the call.
    let table = unsafe {
        Columns {
            size: crate::ffi::input(size, size_len),
            data_offset: crate::ffi::input(data_offset, data_offset_len),
            crc: crate::ffi::input(crc, crc_len),
            method: crate::ffi::input(method, method_len),
        }
    };
    // SAFETY: the caller's contract: the three tables are valid, filled, for the call.
    let (a, spec, cols) = unsafe { (&*api, &*spec, &*cols) };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe {
        crate::ffi::guard(out, move || {
            if !Api::complete(a) {
                return Ok(None);
            }
            let api = Api { a, spec };
            Ok(build(&api, cols, table, result).ok())
        })
    }
}
