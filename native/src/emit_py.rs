//! The emitter's way in: reading the live Python tree into an [`Arena`] through CPython's C API.
//!
//! Why not bytes: the tree exists only as Python objects, and every way of turning it into bytes
//! from Python (the emitter itself, or `pickle.Pickler` with a reducer per record) pays a Python
//! call or more per tensor -- most of what the emitter costs. Reading the objects from here costs
//! a few C calls per object and no Python code at all.
//!
//! The C API is not linked: Python hands over a table of function addresses ([`PyApi`], taken
//! from `ctypes.pythonapi`, stable-ABI functions only) and the objects and types the tree may
//! hold ([`PyTypes`]), so the library still loads without Python (cargo test) and serves every
//! Python 3 version. The function is called through `ctypes.PyDLL`: the GIL is held throughout.
//!
//! Only exact types are read (dict, OrderedDict, list, tuple, str, int, float, bool, None,
//! TensorRef, StorageRef, Global, ParamInfo, Reduce, the EMPTY_HOOKS marker); anything else --
//! a subclass, a set, bytes, an opaque object, an int beyond 64 bits, a string with a lone
//! surrogate, a global that is not allowed -- is [`Unsupported`] and the Python emitter runs.
//! No Python code runs here: a record's fields are read straight from its slots (at offsets
//! Python found on probe objects, used only on objects of that exact type), an OrderedDict's
//! items come from its own C iterator, and its `__dict__` from its C getter.

use std::collections::HashMap;
use std::ffi::{c_char, c_int};
use std::hash::{BuildHasherDefault, Hasher};

use crate::emit::{Arena, Node, Param, Tensor, TensorVals, Unsupported, Val};

/// An opaque `PyObject`.
#[repr(C)]
pub struct PyObject {
    _private: [u8; 0],
}

pub(crate) type Obj = *mut PyObject;

/// Addresses of the C API functions used here (all in the stable ABI), filled by Python.
#[repr(C)]
pub struct PyApi {
    pub dict_next: Option<unsafe extern "C" fn(Obj, *mut isize, *mut Obj, *mut Obj) -> c_int>,
    pub list_size: Option<unsafe extern "C" fn(Obj) -> isize>,
    pub list_get_item: Option<unsafe extern "C" fn(Obj, isize) -> Obj>,
    pub list_append: Option<unsafe extern "C" fn(Obj, Obj) -> c_int>,
    pub tuple_size: Option<unsafe extern "C" fn(Obj) -> isize>,
    pub tuple_get_item: Option<unsafe extern "C" fn(Obj, isize) -> Obj>,
    pub unicode_as_utf8_and_size: Option<unsafe extern "C" fn(Obj, *mut isize) -> *const c_char>,
    pub long_as_long_long_and_overflow: Option<unsafe extern "C" fn(Obj, *mut c_int) -> i64>,
    pub float_as_double: Option<unsafe extern "C" fn(Obj) -> f64>,
    pub object_get_attr: Option<unsafe extern "C" fn(Obj, Obj) -> Obj>,
    pub object_call_object: Option<unsafe extern "C" fn(Obj, Obj) -> Obj>,
    pub object_get_iter: Option<unsafe extern "C" fn(Obj) -> Obj>,
    pub iter_next: Option<unsafe extern "C" fn(Obj) -> Obj>,
    pub dec_ref: Option<unsafe extern "C" fn(Obj)>,
    pub err_occurred: Option<unsafe extern "C" fn() -> Obj>,
    pub err_clear: Option<unsafe extern "C" fn()>,
}

/// The objects, types and attribute names the tree is read with, filled by Python (each kept
/// alive there for the call).
#[repr(C)]
pub struct PyTypes {
    pub none: Obj,
    pub true_: Obj,
    pub false_: Obj,
    pub empty_hooks: Obj,
    pub absent: Obj,
    pub int: Obj,
    pub float: Obj,
    pub str_: Obj,
    pub tuple: Obj,
    pub list: Obj,
    pub dict: Obj,
    pub ordered_dict: Obj,
    pub tensor: Obj,
    pub storage: Obj,
    pub global: Obj,
    pub param: Obj,
    pub reduce: Obj,
    /// OrderedDict's
    pub a_items: Obj,
    pub a_dict: Obj,
    /// where an object's type pointer is (`ob_type`), and where each record slot is, in bytes
    /// from the object's address: found by Python on probe objects (native/emit.py), so no
    /// struct layout is assumed here. Slots are read only from objects of their exact type.
    pub ob_type: usize,
    pub t_storage: usize,
    pub t_storage_offset: usize,
    pub t_shape: usize,
    pub t_stride: usize,
    pub t_requires_grad: usize,
    pub t_hooks: usize,
    pub t_rebuild: usize,
    pub t_dtype_global: usize,
    pub t_metadata: usize,
    pub t_param: usize,
    pub s_storage_type: usize,
    pub s_location: usize,
    pub s_numel: usize,
    pub g_module: usize,
    pub g_name: usize,
    pub g_allowed: usize,
    pub p_requires_grad: usize,
    pub p_hooks: usize,
    pub p_state: usize,
    pub r_func: usize,
    pub r_args: usize,
    pub r_state: usize,
}

/// What [`ckptfix_emit_torch_pickle_whole`] reads besides: where a tensor keeps its dtype (a
/// str) and a storage its item size (an int), and each dtype's item size (`model/dtypes.py`'s
/// table, passed as `u8 name_len, name, u8 itemsize` repeated).
#[repr(C)]
pub struct PyUses {
    pub t_dtype: usize,
    pub s_itemsize: usize,
    pub dtypes_ptr: *const u8,
    pub dtypes_len: usize,
}

/// [`PyUses`] read, and what the builder collects with it.
struct Uses {
    t_dtype: usize,
    s_itemsize: usize,
    itemsizes: HashMap<Vec<u8>, u64>,
    /// dtype str object -> item size (0: not a known dtype)
    by_object: AddressMap<u64>,
    /// per tensor in the arena, its dtype's item size
    tensor_itemsize: Vec<u64>,
    /// per node, its `itemsize` if it is a storage (0 otherwise)
    storage_itemsize: Vec<i64>,
}

impl Uses {
    fn new(table: &PyUses, dtypes: &[u8]) -> Option<Uses> {
        let mut itemsizes = HashMap::new();
        let mut rest = dtypes;
        while let Some((&len, tail)) = rest.split_first() {
            let name = tail.get(..len as usize)?;
            let &size = tail.get(len as usize)?;
            itemsizes.insert(name.to_vec(), u64::from(size));
            rest = &tail[len as usize + 1..];
        }
        Some(Uses {
            t_dtype: table.t_dtype,
            s_itemsize: table.s_itemsize,
            itemsizes,
            by_object: AddressMap::default(),
            tensor_itemsize: Vec::new(),
            storage_itemsize: Vec::new(),
        })
    }
}

/// Whether every storage a tensor uses is spanned whole by one of its tensors: then
/// `formats/compact.py`'s `compact_storages` has nothing to cut (it cuts only storages no tensor
/// spans from first byte to last), and the tree is written as it is. Its test, per tensor:
/// offset 0 and `extent * itemsize >= storage numel * storage itemsize`, the extent as its
/// `_extent` computes it. A tensor it cannot decide (an unknown dtype, a value past 128 bits,
/// shape and stride of different lengths) makes the answer false: Python then runs the
/// reference, which meets the same tensor (and raises whatever it raises about it).
fn storages_used_whole(arena: &Arena, uses: &Uses) -> bool {
    const USED: u8 = 1;
    const WHOLE: u8 = 2;
    let mut seen = vec![0u8; arena.nodes.len()]; // per storage node: used, spanned whole
    for (tensor, &itemsize) in arena.tensors.iter().zip(&uses.tensor_itemsize) {
        let storage_itemsize = uses.storage_itemsize.get(tensor.storage as usize).copied();
        let Some(state) = seen.get_mut(tensor.storage as usize) else {
            return false;
        };
        *state |= USED;
        match spans_whole(arena, tensor, itemsize, storage_itemsize) {
            Some(true) => *state |= WHOLE,
            Some(false) => {}
            None => return false, // one it cannot decide: the reference decides them all
        }
    }
    arena.tensors.len() == uses.tensor_itemsize.len() && seen.iter().all(|&s| s != USED)
}

fn spans_whole(
    arena: &Arena,
    tensor: &crate::emit::Tensor,
    itemsize: u64,
    storage_itemsize: Option<i64>,
) -> Option<bool> {
    if itemsize == 0 {
        return None; // not a known dtype: the reference's own error
    }
    if tensor.offset != 0 {
        return Some(false);
    }
    let Node::Storage { numel, .. } = arena.nodes.get(tensor.storage as usize)? else {
        return None;
    };
    let (shape, stride) = (arena.ints_of(tensor.shape), arena.ints_of(tensor.stride));
    if shape.len() != stride.len() {
        return None;
    }
    let extent: i128 = if shape.len() == 1 && stride[0] == 1 {
        i128::from(shape[0])
    } else if shape.contains(&0) {
        0
    } else {
        let mut sum = 1i128;
        for (&n, &s) in shape.iter().zip(stride) {
            sum = sum.checked_add((i128::from(n) - 1).checked_mul(i128::from(s))?)?;
        }
        sum
    };
    let used = extent.checked_mul(i128::from(itemsize))?;
    let nbytes = i128::from(*numel).checked_mul(i128::from(storage_itemsize?))?;
    Some(used >= nbytes)
}

/// The C API with every function present, behind methods that each hold one `unsafe` call.
///
/// Invariant for every method: the GIL is held (the exported function is only called through
/// `ctypes.PyDLL`), and every object passed in is alive -- it is reachable from the root the
/// caller holds, and nothing here runs Python code or changes the tree, so nothing reachable is
/// freed during the call.
pub(crate) struct Api {
    dict_next: unsafe extern "C" fn(Obj, *mut isize, *mut Obj, *mut Obj) -> c_int,
    list_size: unsafe extern "C" fn(Obj) -> isize,
    list_get_item: unsafe extern "C" fn(Obj, isize) -> Obj,
    list_append: unsafe extern "C" fn(Obj, Obj) -> c_int,
    tuple_size: unsafe extern "C" fn(Obj) -> isize,
    tuple_get_item: unsafe extern "C" fn(Obj, isize) -> Obj,
    as_utf8: unsafe extern "C" fn(Obj, *mut isize) -> *const c_char,
    as_i64: unsafe extern "C" fn(Obj, *mut c_int) -> i64,
    as_f64: unsafe extern "C" fn(Obj) -> f64,
    get_attr: unsafe extern "C" fn(Obj, Obj) -> Obj,
    call: unsafe extern "C" fn(Obj, Obj) -> Obj,
    get_iter: unsafe extern "C" fn(Obj) -> Obj,
    iter_next: unsafe extern "C" fn(Obj) -> Obj,
    dec_ref: unsafe extern "C" fn(Obj),
    err_occurred: unsafe extern "C" fn() -> Obj,
    err_clear: unsafe extern "C" fn(),
    ob_type: usize,
}

/// A new (owned) reference, released when dropped.
struct Owned<'a> {
    api: &'a Api,
    obj: Obj,
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        // SAFETY: `obj` is a new reference this guard owns (non-null by construction); the
        // object it names stays alive through its owner in the tree or is a temporary (a bound
        // method, an iterator, an items tuple) whose release runs no Python code.
        unsafe { (self.api.dec_ref)(self.obj) }
    }
}

impl Api {
    pub(crate) fn new(table: &PyApi, ob_type: usize) -> Option<Api> {
        Some(Api {
            ob_type,
            dict_next: table.dict_next?,
            list_size: table.list_size?,
            list_get_item: table.list_get_item?,
            list_append: table.list_append?,
            tuple_size: table.tuple_size?,
            tuple_get_item: table.tuple_get_item?,
            as_utf8: table.unicode_as_utf8_and_size?,
            as_i64: table.long_as_long_long_and_overflow?,
            as_f64: table.float_as_double?,
            get_attr: table.object_get_attr?,
            call: table.object_call_object?,
            get_iter: table.object_get_iter?,
            iter_next: table.iter_next?,
            dec_ref: table.dec_ref?,
            err_occurred: table.err_occurred?,
            err_clear: table.err_clear?,
        })
    }

    /// Any failure: clear Python's error (the Python emitter runs instead and meets its own).
    fn fail<T>(&self) -> Result<T, Unsupported> {
        // SAFETY: GIL held (struct invariant); clearing the error indicator is always allowed.
        unsafe { (self.err_clear)() };
        Err(Unsupported)
    }

    fn owned(&self, obj: Obj) -> Result<Owned<'_>, Unsupported> {
        if obj.is_null() {
            return self.fail();
        }
        Ok(Owned { api: self, obj })
    }

    pub(crate) fn type_of(&self, obj: Obj) -> Obj {
        // SAFETY: struct invariant (`obj` is a live object); `ob_type` is the offset of its
        // type pointer, which Python found on probe objects and every object has.
        unsafe {
            obj.cast::<u8>()
                .add(self.ob_type)
                .cast::<Obj>()
                .read_unaligned()
        }
    }

    /// A record's slot (a borrowed reference held by the record), or Unsupported if unset.
    pub(crate) fn slot(&self, obj: Obj, offset: usize) -> Result<Obj, Unsupported> {
        // SAFETY: struct invariant; callers pass only objects whose exact type they checked,
        // with that type's slot offset (found by Python within its basic size).
        let value = unsafe { obj.cast::<u8>().add(offset).cast::<Obj>().read_unaligned() };
        if value.is_null() {
            return Err(Unsupported);
        }
        Ok(value)
    }

    fn attr(&self, obj: Obj, name: Obj) -> Result<Obj, Unsupported> {
        // SAFETY: struct invariant; `name` is a str the caller keeps alive. On the exact types
        // read here the attribute is a slot (or OrderedDict's C getter), so no Python code runs.
        let value = unsafe { (self.get_attr)(obj, name) };
        // the new reference is released at once: `obj` holds the value (a slot, or the
        // `__dict__` it keeps), so the borrowed pointer stays valid for the call
        Ok(self.owned(value)?.obj)
    }

    pub(crate) fn list_items(&self, list: Obj, into: &mut Vec<Obj>) -> Result<(), Unsupported> {
        // SAFETY: struct invariant; `list` is an exact list.
        let n = unsafe { (self.list_size)(list) };
        for i in 0..n.max(0) {
            // SAFETY: struct invariant; 0 <= i < size; the item is borrowed from the list.
            let item = unsafe { (self.list_get_item)(list, i) };
            if item.is_null() {
                return self.fail();
            }
            into.push(item);
        }
        Ok(())
    }

    fn tuple_items(&self, tuple: Obj, into: &mut Vec<Obj>) -> Result<(), Unsupported> {
        // SAFETY: struct invariant; `tuple` is an exact tuple.
        let n = unsafe { (self.tuple_size)(tuple) };
        for i in 0..n.max(0) {
            // SAFETY: struct invariant; 0 <= i < size; the item is borrowed from the tuple.
            let item = unsafe { (self.tuple_get_item)(tuple, i) };
            if item.is_null() {
                return self.fail();
            }
            into.push(item);
        }
        Ok(())
    }

    /// A dict's keys and values, interleaved, in its iteration order.
    fn dict_items(&self, dict: Obj, into: &mut Vec<Obj>) {
        let mut pos: isize = 0;
        let (mut key, mut value): (Obj, Obj) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: struct invariant; `dict` is an exact dict not changed during the loop; key
        // and value are borrowed from it.
        while unsafe { (self.dict_next)(dict, &mut pos, &mut key, &mut value) } != 0 {
            into.push(key);
            into.push(value);
        }
    }

    /// An OrderedDict's keys and values in its own order (which `move_to_end` makes differ from
    /// the underlying dict's), from `od.items()`'s C iterator.
    fn ordered_items(
        &self,
        od: Obj,
        items_name: Obj,
        into: &mut Vec<Obj>,
    ) -> Result<(), Unsupported> {
        // SAFETY: struct invariant; `od` is an exact OrderedDict, whose `items` is a C method.
        let method = self.owned(unsafe { (self.get_attr)(od, items_name) })?;
        // SAFETY: struct invariant; calling it with no arguments makes a C items view.
        let view = self.owned(unsafe { (self.call)(method.obj, std::ptr::null_mut()) })?;
        // SAFETY: struct invariant; the view's iterator is C code too. Each item it yields is a
        // new reference to a 2-tuple whose key and value the OrderedDict itself holds.
        let iter = self.owned(unsafe { (self.get_iter)(view.obj) })?;
        loop {
            // SAFETY: as above.
            let item = unsafe { (self.iter_next)(iter.obj) };
            if item.is_null() {
                // SAFETY: struct invariant.
                if unsafe { (self.err_occurred)() }.is_null() {
                    return Ok(());
                }
                return self.fail();
            }
            let item = self.owned(item)?;
            let start = into.len();
            self.tuple_items(item.obj, into)?;
            if into.len() != start + 2 {
                return self.fail();
            }
        }
    }

    fn utf8(&self, text: Obj) -> Result<&[u8], Unsupported> {
        let mut size: isize = 0;
        // SAFETY: struct invariant; `text` is an exact str. A lone surrogate fails (the
        // Python emitter writes it with surrogatepass): Unsupported.
        let data = unsafe { (self.as_utf8)(text, &mut size) };
        if data.is_null() || size < 0 {
            return self.fail();
        }
        // SAFETY: CPython returns `size` bytes at `data`, owned by (cached in) the str object,
        // which outlives this call.
        Ok(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size as usize) })
    }

    pub(crate) fn int(&self, value: Obj) -> Result<i64, Unsupported> {
        let mut overflow: c_int = 0;
        // SAFETY: struct invariant; `value` is an exact int.
        let result = unsafe { (self.as_i64)(value, &mut overflow) };
        // SAFETY: struct invariant.
        if overflow != 0 || (result == -1 && !unsafe { (self.err_occurred)() }.is_null()) {
            return self.fail(); // beyond 64 bits: left to Python
        }
        Ok(result)
    }

    fn float(&self, value: Obj) -> f64 {
        // SAFETY: struct invariant; `value` is an exact float (no conversion can fail).
        unsafe { (self.as_f64)(value) }
    }

    pub(crate) fn append(&self, list: Obj, item: Obj) -> Result<(), Unsupported> {
        // SAFETY: struct invariant; `list` is the caller's exact list, `item` a live object.
        if unsafe { (self.list_append)(list, item) } != 0 {
            return self.fail();
        }
        Ok(())
    }
}

/// A hasher for object addresses (distinct pointers; SipHash's strength is not needed).
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type AddressMap<V> = HashMap<usize, V, BuildHasherDefault<AddressHasher>>;

/// What a node made for an object still has to read (filled in a second step, so shared
/// objects and cycles resolve to the same node).
enum Todo {
    Fill(u32, Obj),
}

/// The node made for each object, by address: an open-addressing table of node numbers
/// (`objects[node]` holds the node's object, so a slot needs only the 4-byte number). A
/// checkpoint has ~2 nodes a tensor; a `HashMap<usize, u32>` spent ~37 bytes a node on them
/// (16-byte entries, a control byte, at most 7/8 full, doubled: 17 MB at 200 000 tensors,
/// the emitter's largest part after the tensors), this ~8-16.
struct NodeIndex {
    slots: Vec<u32>,
    len: usize,
}

const EMPTY_SLOT: u32 = u32::MAX;

impl NodeIndex {
    fn new() -> NodeIndex {
        NodeIndex {
            slots: vec![EMPTY_SLOT; 1024],
            len: 0,
        }
    }

    /// The first slot to probe for `address` (objects are 16-byte aligned: the low bits say
    /// nothing; the multiply spreads the rest over the table's power-of-two size).
    fn home(address: usize, mask: usize) -> usize {
        ((address as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & mask
    }

    fn get(&self, objects: &[Obj], obj: Obj) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut at = Self::home(obj as usize, mask);
        loop {
            let node = self.slots[at];
            if node == EMPTY_SLOT {
                return None;
            }
            if objects[node as usize] == obj {
                return Some(node);
            }
            at = (at + 1) & mask;
        }
    }

    /// Note `node` (`objects[node]`, not in the table yet); the table stays at most half full.
    fn insert(&mut self, objects: &[Obj], node: u32) {
        if (self.len + 1) * 2 > self.slots.len() {
            let grown = vec![EMPTY_SLOT; self.slots.len() * 2];
            let old = std::mem::replace(&mut self.slots, grown);
            for n in old.into_iter().filter(|n| *n != EMPTY_SLOT) {
                self.place(objects, n);
            }
        }
        self.place(objects, node);
        self.len += 1;
    }

    fn place(&mut self, objects: &[Obj], node: u32) {
        let mask = self.slots.len() - 1;
        let mut at = Self::home(objects[node as usize] as usize, mask);
        while self.slots[at] != EMPTY_SLOT {
            at = (at + 1) & mask;
        }
        self.slots[at] = node;
    }
}

struct Builder<'a> {
    api: &'a Api,
    types: &'a PyTypes,
    arena: Arena,
    nodes: NodeIndex,
    globals: AddressMap<Val>,
    /// shapes and strides already read (tensors share them), by object
    int_spans: AddressMap<crate::emit::Span>,
    /// storage locations already read ("cpu" is one object for all storages), by object
    locations: AddressMap<u32>,
    objects: Vec<Obj>,
    todo: Vec<Todo>,
    scratch: Vec<Obj>,
    /// also read what compaction needs (the `_whole` entry point)
    uses: Option<Uses>,
}

impl Builder<'_> {
    /// The value for `obj`: an atom read at once, or a node (made now, filled later).
    fn value(&mut self, obj: Obj) -> Result<Val, Unsupported> {
        let t = self.types;
        if obj == t.none {
            return Ok(Val::None);
        }
        if obj == t.true_ {
            return Ok(Val::Bool(true));
        }
        if obj == t.false_ {
            return Ok(Val::Bool(false));
        }
        if obj == t.empty_hooks {
            return Ok(Val::EmptyHooks);
        }
        let ty = self.api.type_of(obj);
        if ty == t.str_ {
            let bytes = self.api.utf8(obj)?;
            return self.arena.add_str(bytes);
        }
        if ty == t.int {
            return Ok(Val::Int(self.api.int(obj)?));
        }
        if ty == t.float {
            return Ok(Val::Float(self.api.float(obj)));
        }
        if ty == t.global {
            return self.global(obj);
        }
        if let Some(node) = self.nodes.get(&self.objects, obj) {
            return Ok(Val::Node(node));
        }
        let known = [
            t.dict,
            t.ordered_dict,
            t.list,
            t.tuple,
            t.tensor,
            t.storage,
            t.reduce,
        ];
        if !known.contains(&ty) {
            return Err(Unsupported); // ABSENT out of place, a subclass, a set, bytes, ...
        }
        let node = self.arena.add_node(Node::Pending)?;
        debug_assert_eq!(node as usize, self.objects.len());
        self.objects.push(obj);
        self.nodes.insert(&self.objects, node);
        self.todo.push(Todo::Fill(node, obj));
        Ok(Val::Node(node))
    }

    /// A slot that may hold ABSENT.
    fn optional(&mut self, obj: Obj) -> Result<Val, Unsupported> {
        if obj == self.types.absent {
            return Ok(Val::Absent);
        }
        self.value(obj)
    }

    fn global(&mut self, obj: Obj) -> Result<Val, Unsupported> {
        if let Some(&value) = self.globals.get(&(obj as usize)) {
            return Ok(value);
        }
        let t = self.types;
        if self.api.slot(obj, t.g_allowed)? != t.true_ {
            return Err(Unsupported); // not allowed: the Python emitter refuses it by name
        }
        let (module, name) = (
            self.api.slot(obj, t.g_module)?,
            self.api.slot(obj, t.g_name)?,
        );
        if self.api.type_of(module) != t.str_ || self.api.type_of(name) != t.str_ {
            return Err(Unsupported);
        }
        let module = std::str::from_utf8(self.api.utf8(module)?)
            .map_err(|_| Unsupported)?
            .to_string();
        let name = std::str::from_utf8(self.api.utf8(name)?)
            .map_err(|_| Unsupported)?
            .to_string();
        let value = self.arena.add_global(&module, &name)?;
        self.globals.insert(obj as usize, value);
        Ok(value)
    }

    fn global_index(&mut self, obj: Obj) -> Result<u32, Unsupported> {
        if self.api.type_of(obj) != self.types.global {
            return Err(Unsupported);
        }
        match self.global(obj)? {
            Val::Global(index) => Ok(index),
            _ => Err(Unsupported),
        }
    }

    fn exact_int(&self, obj: Obj) -> Result<i64, Unsupported> {
        if self.api.type_of(obj) != self.types.int {
            return Err(Unsupported); // a bool or anything else: the Python emitter's own path
        }
        self.api.int(obj)
    }

    /// A shape or stride: a tuple or list of exact ints.
    fn ints(&mut self, obj: Obj) -> Result<crate::emit::Span, Unsupported> {
        if let Some(&span) = self.int_spans.get(&(obj as usize)) {
            return Ok(span);
        }
        let ty = self.api.type_of(obj);
        let mut items = std::mem::take(&mut self.scratch);
        items.clear();
        if ty == self.types.tuple {
            self.api.tuple_items(obj, &mut items)?;
        } else if ty == self.types.list {
            self.api.list_items(obj, &mut items)?;
        } else {
            return Err(Unsupported);
        }
        let mut values = Vec::with_capacity(items.len());
        for &item in &items {
            values.push(self.exact_int(item)?);
        }
        self.scratch = items;
        let span = self.arena.add_ints(&values)?;
        self.int_spans.insert(obj as usize, span);
        Ok(span)
    }

    /// Values for `objs` (interned in order), stored as one span.
    fn span(&mut self, objs: &[Obj]) -> Result<crate::emit::Span, Unsupported> {
        let mut vals = Vec::with_capacity(objs.len());
        for &obj in objs {
            vals.push(self.value(obj)?);
        }
        self.arena.add_vals(&vals)
    }

    fn fill(&mut self, node: u32, obj: Obj) -> Result<(), Unsupported> {
        let t = self.types;
        let api = self.api;
        let ty = api.type_of(obj);
        let mut items = Vec::new();
        let filled = if ty == t.dict {
            api.dict_items(obj, &mut items);
            Node::Dict(self.span(&items)?)
        } else if ty == t.list {
            api.list_items(obj, &mut items)?;
            Node::List(self.span(&items)?)
        } else if ty == t.tuple {
            api.tuple_items(obj, &mut items)?;
            Node::Tuple(self.span(&items)?)
        } else if ty == t.ordered_dict {
            // getattr(od, "__dict__"): made on first access, as the Python emitter's getattr does.
            // Read first: `od.items` below must be OrderedDict's C method, so no instance
            // attribute may shadow it (one set in code is Python code, which could free what is
            // read here), and every attribute name must be an exact str (a key's `__eq__` would
            // run in that lookup)
            let attrs = api.attr(obj, t.a_dict)?;
            if api.type_of(attrs) != t.dict {
                return Err(Unsupported);
            }
            let mut probe = Vec::new();
            api.dict_items(attrs, &mut probe);
            for &name in probe.iter().step_by(2) {
                if api.type_of(name) != t.str_ || api.utf8(name)? == b"items" {
                    return Err(Unsupported);
                }
            }
            // the items iterator hashes each key: only keys whose hash is C code (PyDict_Next
            // reads the OrderedDict's dict part without hashing)
            api.dict_items(obj, &mut items);
            if items
                .iter()
                .step_by(2)
                .any(|&key| api.type_of(key) != t.str_ && api.type_of(key) != t.int)
            {
                return Err(Unsupported);
            }
            items.clear();
            api.ordered_items(obj, t.a_items, &mut items)?;
            let span = self.span(&items)?;
            let attrs = if probe.is_empty() {
                None
            } else {
                Some(self.value(attrs)?)
            };
            Node::OrderedDict(span, attrs)
        } else if ty == t.storage {
            let storage_type = self.global_index(api.slot(obj, t.s_storage_type)?)?;
            let location_obj = api.slot(obj, t.s_location)?;
            let location = match self.locations.get(&(location_obj as usize)) {
                Some(&index) => index,
                None => {
                    if api.type_of(location_obj) != t.str_ {
                        return Err(Unsupported);
                    }
                    let Val::Str(index) = self.value(location_obj)? else {
                        return Err(Unsupported);
                    };
                    self.locations.insert(location_obj as usize, index);
                    index
                }
            };
            let numel = self.exact_int(api.slot(obj, t.s_numel)?)?;
            if let Some(at) = self.uses.as_ref().map(|u| u.s_itemsize) {
                let itemsize = self.exact_int(api.slot(obj, at)?)?;
                if let Some(uses) = self.uses.as_mut() {
                    let at = node as usize;
                    if uses.storage_itemsize.len() <= at {
                        uses.storage_itemsize.resize(at + 1, 0);
                    }
                    uses.storage_itemsize[at] = itemsize;
                }
            }
            Node::Storage {
                storage_type,
                location,
                numel,
            }
        } else if ty == t.reduce {
            let func = self.global_index(api.slot(obj, t.r_func)?)?;
            let args = api.slot(obj, t.r_args)?;
            if api.type_of(args) != t.tuple {
                return Err(Unsupported);
            }
            let Val::Node(args) = self.value(args)? else {
                return Err(Unsupported);
            };
            let state = self.optional(api.slot(obj, t.r_state)?)?;
            Node::Reduce { func, args, state }
        } else if ty == t.tensor {
            return self.tensor(node, obj);
        } else {
            return Err(Unsupported);
        };
        self.arena.nodes[node as usize] = filled;
        Ok(())
    }

    fn tensor(&mut self, node: u32, obj: Obj) -> Result<(), Unsupported> {
        let t = self.types;
        let api = self.api;
        let storage = api.slot(obj, t.t_storage)?;
        if api.type_of(storage) != t.storage {
            return Err(Unsupported);
        }
        let Val::Node(storage) = self.value(storage)? else {
            return Err(Unsupported);
        };
        let offset = self.exact_int(api.slot(obj, t.t_storage_offset)?)?;
        let shape = self.ints(api.slot(obj, t.t_shape)?)?;
        let stride = self.ints(api.slot(obj, t.t_stride)?)?;
        let requires_grad = self.value(api.slot(obj, t.t_requires_grad)?)?;
        let hooks = self.value(api.slot(obj, t.t_hooks)?)?;
        let rebuild = api.slot(obj, t.t_rebuild)?;
        let v3 = api.type_of(rebuild) == t.str_ && api.utf8(rebuild)? == b"v3";
        let dtype_global = self.value(api.slot(obj, t.t_dtype_global)?)?;
        let metadata = self.optional(api.slot(obj, t.t_metadata)?)?;
        let param = api.slot(obj, t.t_param)?;
        let param = if param == t.none {
            None
        } else {
            Some(Box::new(self.param(param)?))
        };
        let tensor = Tensor {
            storage,
            vals: 0,
            offset,
            shape,
            stride,
            v3,
            param,
        };
        let vals = TensorVals {
            requires_grad,
            hooks,
            dtype_global,
            metadata,
        };
        let index = self.arena.push_tensor(tensor, vals)?;
        self.arena.nodes[node as usize] = Node::Tensor(index);
        if let Some(uses) = self.uses.as_mut() {
            let dtype = api.slot(obj, uses.t_dtype)?;
            let itemsize = match uses.by_object.get(&(dtype as usize)) {
                Some(&size) => size,
                None => {
                    let size = if api.type_of(dtype) == t.str_ {
                        uses.itemsizes.get(api.utf8(dtype)?).copied().unwrap_or(0)
                    } else {
                        0
                    };
                    uses.by_object.insert(dtype as usize, size);
                    size
                }
            };
            uses.tensor_itemsize.push(itemsize);
        }
        Ok(())
    }

    /// A parameter's record. Only the forms whose walk the arena replays exactly: atoms or
    /// markers for requires_grad and hooks (or an empty OrderedDict), and no state -- the walk
    /// enters a fresh tuple per parameter, whose identity Python may reuse (see emit.rs).
    fn param(&mut self, obj: Obj) -> Result<Param, Unsupported> {
        let t = self.types;
        if self.api.type_of(obj) != t.param {
            return Err(Unsupported);
        }
        let requires_grad = self.value(self.api.slot(obj, t.p_requires_grad)?)?;
        let hooks = self.value(self.api.slot(obj, t.p_hooks)?)?;
        let state = self.optional(self.api.slot(obj, t.p_state)?)?;
        let plain = |v: Val| {
            matches!(
                v,
                Val::None
                    | Val::Bool(_)
                    | Val::Int(_)
                    | Val::Float(_)
                    | Val::Str(_)
                    | Val::EmptyHooks
            )
        };
        let empty_od = |v: Val| matches!(v, Val::Node(_));
        if !plain(requires_grad) || !(plain(hooks) || empty_od(hooks)) || state != Val::Absent {
            return Err(Unsupported);
        }
        Ok(Param {
            requires_grad,
            hooks,
            state,
        })
    }

    /// Fill every node made, then check the parameters' OrderedDict hooks are empty.
    fn finish(&mut self) -> Result<(), Unsupported> {
        while let Some(Todo::Fill(node, obj)) = self.todo.pop() {
            self.fill(node, obj)?;
        }
        for tensor in &self.arena.tensors {
            if let Some(Param {
                hooks: Val::Node(n),
                ..
            }) = tensor.param.as_deref()
            {
                if !matches!(self.arena.nodes[*n as usize], Node::OrderedDict(span, None) if span.len == 0)
                {
                    return Err(Unsupported);
                }
            }
        }
        Ok(())
    }
}

/// Read `root` into an arena; the arena, the root's value, each node's object, and what `uses`
/// collected.
fn build(
    api: &Api,
    types: &PyTypes,
    root: Obj,
    uses: Option<Uses>,
) -> Result<(Arena, Val, Vec<Obj>, Option<Uses>), Unsupported> {
    let mut builder = Builder {
        uses,
        api,
        types,
        arena: Arena::new(),
        nodes: NodeIndex::new(),
        globals: AddressMap::default(),
        int_spans: AddressMap::default(),
        locations: AddressMap::default(),
        objects: Vec::new(),
        todo: Vec::new(),
        scratch: Vec::new(),
    };
    let root = builder.value(root)?;
    builder.finish()?;
    Ok((builder.arena, root, builder.objects, builder.uses))
}

/// The pickle of `root` (storages appended to `storages`), and with `uses`, whether every
/// storage is used whole ([`storages_used_whole`]); `None` for the Python emitter.
fn emit(
    api: &PyApi,
    types: &PyTypes,
    uses: Option<Uses>,
    root: Obj,
    storages: Obj,
) -> Option<(Vec<u8>, bool)> {
    let api = Api::new(api, types.ob_type)?;
    if root.is_null() || storages.is_null() {
        return None;
    }
    let (arena, root, objects, uses) = build(&api, types, root, uses).ok()?;
    let whole = uses
        .as_ref()
        .is_some_and(|uses| storages_used_whole(&arena, uses));
    let pickled = crate::emit::dumps(&arena, root).ok()?;
    for node in pickled.storages {
        api.append(storages, objects[node as usize]).ok()?;
    }
    Some((pickled.data, whole))
}

/// Pickle the tree `root` as `ckptfix.pickling.writer.dumps` does. On OK the output is the
/// pickle and `storages` (an empty list) has received the StorageRef objects in key order;
/// UNSUPPORTED leaves the tree to the Python emitter.
///
/// # Safety
/// Call with the GIL held (`ctypes.PyDLL`): `api` and `types` point to tables filled as
/// `ckptfix/native/emit.py` fills them, `root` and `storages` are live objects (`storages` an
/// exact list), and no other thread changes the tree during the call. `out` as in `ffi::guard`.
#[no_mangle]
pub unsafe extern "C" fn ckptfix_emit_torch_pickle(
    api: *const PyApi,
    types: *const PyTypes,
    root: Obj,
    storages: Obj,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract above: each table pointer is null or valid for reads.
    let tables = unsafe { (api.as_ref(), types.as_ref()) };
    let body = move || -> Result<Option<Vec<u8>>, String> {
        let (Some(api), Some(types)) = tables else {
            return Ok(None);
        };
        Ok(emit(api, types, None, root, storages).map(|(data, _)| data))
    };
    // SAFETY: `out` is the caller's out-parameter (ffi::guard's contract).
    unsafe { crate::ffi::guard(out, std::panic::AssertUnwindSafe(body)) }
}

/// [`ckptfix_emit_torch_pickle`], also reading what compaction needs (`uses`): `*whole` is set
/// to 1 when every storage a tensor uses is spanned whole by one of its tensors (so
/// `compact_storages` would return the tree unchanged), else 0.
///
/// # Safety
/// As [`ckptfix_emit_torch_pickle`]; `uses` points to a [`PyUses`] filled by
/// `ckptfix/native/emit.py` whose table is readable for the call, and `whole` is valid for one
/// write.
#[no_mangle]
pub unsafe extern "C" fn ckptfix_emit_torch_pickle_whole(
    api: *const PyApi,
    types: *const PyTypes,
    uses: *const PyUses,
    root: Obj,
    storages: Obj,
    whole: *mut u8,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract above: each table pointer is null or valid for reads.
    let tables = unsafe { (api.as_ref(), types.as_ref(), uses.as_ref()) };
    // SAFETY: the caller's contract: the dtype table is readable for the call.
    let dtypes = unsafe {
        tables
            .2
            .map(|u| crate::ffi::input(u.dtypes_ptr, u.dtypes_len))
    };
    let mut found = false;
    let found_ref = &mut found;
    let body = move || -> Result<Option<Vec<u8>>, String> {
        let (Some(api), Some(types), Some(uses), Some(dtypes)) =
            (tables.0, tables.1, tables.2, dtypes)
        else {
            return Ok(None);
        };
        let Some(uses) = Uses::new(uses, dtypes) else {
            return Ok(None);
        };
        Ok(
            emit(api, types, Some(uses), root, storages).map(|(data, all_whole)| {
                *found_ref = all_whole;
                data
            }),
        )
    };
    // SAFETY: `out` is the caller's out-parameter (ffi::guard's contract).
    let status = unsafe { crate::ffi::guard(out, std::panic::AssertUnwindSafe(body)) };
    if !whole.is_null() {
        // SAFETY: the caller's contract: `whole` is valid for one write.
        unsafe { whole.write(u8::from(found)) };
    }
    status
}
