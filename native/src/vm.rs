//! The pickle VM of the reader, natively: `ckptfix/pickling/vm.py` + `reader.py`'s hooks for the
//! subset of pickles real checkpoints are made of.
//!
//! It runs over a `data.pkl` with the same budgets, the same charges per opcode, the same memo
//! rules and the same reading of FRAMEs as the Python VM (`Budgets.for_length`, `charge`,
//! `take`/`take_into`/`line`), and with the reader's hooks (allow-list, tensor rebuilds,
//! storages, `OrderedDict` with `_metadata`) for what it supports. Anything else -- an opcode or
//! a global outside its subset, a call it does not build, a frame crossing, a budget reached, a
//! key it does not hash, malformed input -- is [`Unsup`]: the function returns UNSUPPORTED and
//! the Python VM reads the same bytes, so every error and every rare construct keeps the
//! reference semantics by construction. A result returned here is one the Python VM would build
//! without an error of its own (errors that depend on the zip records -- a missing storage --
//! are raised by Python's `load_storage`, called for every persistent id in pickle order).
//!
//! What Python gets (see `ckptfix/pickling/native_tree.py`): one buffer holding two pickles, each
//! a single FRAME (CPython's C unpickler then reads each with one `read()`):
//!
//! 1. `meta`: `(end, [(module, name), ...], kinds, keys, locations, numels)` -- where the pickle
//!    ended, the globals it named (in first-use order), and each storage persistent id as
//!    columns (storage class as an index into the globals, key, location, numel);
//! 2. `tree`: a plain pickle of the tree, with no GLOBAL: every record is a persistent id into
//!    a table Python builds from `meta` (the `PID_*` entries below + globals + storages + their
//!    dtypes); tensors, `Reduce` records and `ParamInfo`s are REDUCE calls of the record classes
//!    themselves (their dataclass `__init__`: the only Python code that runs per tensor, besides
//!    `load_storage`). Memo sharing is kept: every object the input pickle reaches twice is one
//!    object in the output.
//!
//! Everything is iterative; every length is checked against the bytes there before it is used;
//! memory is bounded by the input's length (the objects budget) and the output by the objects.

use std::collections::HashMap;

/// The input uses something left to the Python VM (or is malformed: Python says how).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsup;

type R<T> = Result<T, Unsup>;

/// `Budgets` (vm.py), as the caller computed them.
#[derive(Debug, Clone, Copy)]
pub struct Budgets {
    pub max_objects: u64,
    pub max_alloc: u64,
    pub max_memo: u64,
}

/// What a global is, for this VM: the reader's builders it knows, as Python's config says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `_rebuild_tensor` (4 fixed arguments), `_v2` (6), `_v3` (7)
    Tensor(u8),
    /// `_rebuild_parameter` (false) / `_rebuild_parameter_with_state` (true)
    Param(bool),
    /// `collections.OrderedDict`
    ODict,
    /// a Python builder this VM does not run (Counter, set, bytearray...): calling it is Unsup
    Other,
    /// any other allowed torch name: calling it makes a `Reduce` record
    Reduce,
}

#[derive(Debug, Clone, Copy)]
struct GlobalInfo {
    kind: Kind,
    storage: bool,
    dtype: bool,
    /// the element size of a storage class's or a dtype's elements (0: not given)
    itemsize: u8,
}

/// The allow-list, parsed from Python's config: `kind flags\tmodule\tname\n` per name.
pub struct Config {
    names: HashMap<(Vec<u8>, Vec<u8>), GlobalInfo>,
}

impl Config {
    /// Parse the table `ckptfix/pickling/native_tree.py` writes (`None` if malformed: a bug).
    pub fn parse(text: &[u8]) -> Option<Config> {
        let mut names = HashMap::new();
        for line in text.split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split(|&b| b == b'\t');
            let (code, module, name) = (parts.next()?, parts.next()?, parts.next()?);
            let kind = match code.first()? {
                b'1' => Kind::Tensor(4),
                b'2' => Kind::Tensor(6),
                b'3' => Kind::Tensor(7),
                b'p' => Kind::Param(false),
                b'q' => Kind::Param(true),
                b'o' => Kind::ODict,
                b'x' => Kind::Other,
                b'r' => Kind::Reduce,
                _ => return None,
            };
            // an optional fourth field: the element size (storage classes and dtypes)
            let itemsize = match parts.next() {
                Some(text) => std::str::from_utf8(text).ok()?.parse::<u8>().ok()?,
                None => 0,
            };
            let info = GlobalInfo {
                kind,
                storage: code.contains(&b's'),
                dtype: code.contains(&b'd'),
                itemsize,
            };
            names.insert((module.to_vec(), name.to_vec()), info);
        }
        Some(Config { names })
    }
}

/// A value on the stack or in a container. Copy: identity is the index it carries.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Val {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// an index into `atoms` (a str: one per creation, so memo sharing is kept)
    Str(u32),
    Bytes(u32),
    EmptyTuple,
    Node(u32),
    /// an index into the globals used
    Global(u32),
    /// an index into the persistent ids (one StorageRef per occurrence, as `load_storage` returns)
    Storage(u32),
    /// the empty backward-hooks OrderedDict, replaced by `EMPTY_HOOKS` as `_tensor` does
    EmptyHooks,
}

struct Tensor {
    storage: u32,
    offset: i64,
    /// the checked size and stride tuples (or lists) as the pickle gave them
    shape: Val,
    stride: Val,
    requires_grad: bool,
    hooks: Val,
    /// `_rebuild_tensor_v3`'s dtype global
    v3: Option<u32>,
    metadata: Option<Val>,
    /// `ParamInfo(requires_grad, hooks, state)` (boxed: rare)
    param: Option<Box<(Val, Val, Option<Val>)>>,
}

enum Node {
    /// `pool[start..start + len]`: tuples never change, so their items sit in one pool
    Tuple(u32, u32),
    List(Vec<Val>),
    /// every pair set, duplicates included: the output replays them, so CPython's dict decides
    /// which key object stays (`1` and `True` are one key), as it does in the Python VM
    Dict(Vec<Val>),
    /// items, and its `__dict__`: [`NO_DICT`], [`EMPTY_DICT`] or an index into `attrs` (its
    /// `_metadata`: kept aside, so a node stays 32 bytes)
    ODict(Vec<Val>, u32),
    /// an index into `tensors`
    Tensor(u32),
    Reduce {
        func: u32,
        args: Val,
    },
}

/// An OrderedDict without a `__dict__` (never BUILT), and one BUILT without `_metadata`.
const NO_DICT: u32 = u32::MAX;
const EMPTY_DICT: u32 = u32::MAX - 1;

/// The persistent ids of the table Python builds before the tree (native_tree.py: `_FIXED`).
const PID_TENSOR: u64 = 0;
const PID_ODICT: u64 = 1;
const PID_ABSENT: u64 = 2;
const PID_EMPTY_HOOKS: u64 = 3;
const PID_REDUCE: u64 = 4;
const PID_PARAMINFO: u64 = 5;
const PID_GLOBALS: u64 = 6;

/// Strings the output uses often, memoized once at the start of the tree pickle.
const SLOTS: [&str; 2] = ["v2", "v3"];

/// `MAX_KEY_NESTING`-free key rules: see `Vm::check_key`.
const MAX_SHAPES: usize = 4096;

struct Vm<'a> {
    data: &'a [u8],
    end: usize,
    limit: usize,
    budgets: Budgets,
    objects: u64,
    alloc: u64,
    key_work: u64,
    max_key_work: u64,
    stack: Vec<Val>,
    marks: Vec<usize>,
    memo: Vec<Val>,
    memo_sparse: HashMap<u64, Val>,
    atoms: Vec<(usize, usize)>,
    nodes: Vec<Node>,
    pool: Vec<Val>,
    tensors: Vec<Tensor>,
    /// OrderedDicts' `_metadata` values
    attrs: Vec<Val>,
    config: &'a Config,
    globals: Vec<(Vec<u8>, Vec<u8>)>,
    global_ids: HashMap<(Vec<u8>, Vec<u8>), u32>,
    global_info: Vec<GlobalInfo>,
    /// persistent ids: (storage class global, key atom, location atom, numel)
    pids: Vec<(u32, u32, u32, i64)>,
    has_loader: bool,
}

use crate::le::{u32_at, u64_at};

impl<'a> Vm<'a> {
    fn charge(&mut self, count: u64, nbytes: u64) -> R<()> {
        self.objects = self.objects.checked_add(count).ok_or(Unsup)?;
        self.alloc = self.alloc.checked_add(nbytes).ok_or(Unsup)?;
        if self.objects > self.budgets.max_objects || self.alloc > self.budgets.max_alloc {
            return Err(Unsup);
        }
        Ok(())
    }

    /// vm.py's `take`: a fixed-size read; one crossing a FRAME's end is the Python VM's business.
    fn take(&mut self, pos: usize, count: usize) -> R<usize> {
        let stop = pos.checked_add(count).ok_or(Unsup)?;
        if stop <= self.limit {
            return Ok(pos);
        }
        if pos < self.limit {
            return Err(Unsup); // frame crossed
        }
        self.limit = self.end;
        if stop > self.end {
            return Err(Unsup); // truncated
        }
        Ok(pos)
    }

    /// vm.py's `take_into` (BINBYTES...: linear through a frame's end).
    fn take_into(&mut self, pos: usize, count: usize) -> R<usize> {
        let stop = pos.checked_add(count).ok_or(Unsup)?;
        if stop > self.limit {
            self.limit = self.end;
            if stop > self.end {
                return Err(Unsup);
            }
        }
        Ok(pos)
    }

    /// vm.py's `line`: (start, stop) of a text line without its newline, and where reading goes on.
    fn line(&mut self, pos: usize) -> R<(usize, usize, usize)> {
        if pos < self.limit && self.limit < self.end {
            return match self.data[pos..self.limit].iter().position(|&b| b == b'\n') {
                Some(i) => Ok((pos, pos + i, pos + i + 1)),
                None => Err(Unsup), // frame crossed
            };
        }
        self.limit = self.end;
        if pos > self.end {
            return Err(Unsup);
        }
        let i = self.data[pos..self.end]
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(Unsup)?;
        self.charge(0, i as u64)?;
        Ok((pos, pos + i, pos + i + 1))
    }

    fn push(&mut self, v: Val) {
        self.stack.push(v);
    }

    fn floor(&self) -> usize {
        *self.marks.last().unwrap_or(&0)
    }

    fn pop(&mut self) -> R<Val> {
        if self.stack.len() <= self.floor() {
            return Err(Unsup);
        }
        self.stack.pop().ok_or(Unsup)
    }

    fn top(&self) -> R<Val> {
        if self.stack.len() <= self.floor() {
            return Err(Unsup);
        }
        self.stack.last().copied().ok_or(Unsup)
    }

    fn pop_mark(&mut self) -> R<Vec<Val>> {
        if self.marks.len() == 1 {
            return Err(Unsup);
        }
        let k = self.marks.pop().ok_or(Unsup)?;
        Ok(self.stack.split_off(k))
    }

    fn tensor(&mut self, t: Tensor) -> R<Val> {
        let id = u32::try_from(self.tensors.len()).map_err(|_| Unsup)?;
        self.tensors.push(t);
        self.node(Node::Tensor(id))
    }

    fn node(&mut self, n: Node) -> R<Val> {
        let id = u32::try_from(self.nodes.len()).map_err(|_| Unsup)?;
        self.nodes.push(n);
        Ok(Val::Node(id))
    }

    fn atom(&mut self, start: usize, len: usize) -> R<u32> {
        let id = u32::try_from(self.atoms.len()).map_err(|_| Unsup)?;
        self.atoms.push((start, len));
        Ok(id)
    }

    fn text(&self, atom: u32) -> &'a [u8] {
        let (s, n) = self.atoms[atom as usize];
        &self.data[s..s + n]
    }

    /// `push_str`: UTF-8 (a surrogate CPython's `surrogatepass` takes is Unsup here), charged.
    fn push_str(&mut self, pos: usize, size: usize) -> R<()> {
        std::str::from_utf8(&self.data[pos..pos + size]).map_err(|_| Unsup)?;
        self.charge(1, 49u64.checked_add(size as u64).ok_or(Unsup)?)?;
        let a = self.atom(pos, size)?;
        self.push(Val::Str(a));
        Ok(())
    }

    fn push_bytes(&mut self, pos: usize, size: usize) -> R<usize> {
        let pos = self.take_into(pos, size)?;
        self.charge(1, 33u64.checked_add(size as u64).ok_or(Unsup)?)?;
        let a = self.atom(pos, size)?;
        self.push(Val::Bytes(a));
        Ok(pos + size)
    }

    fn put(&mut self, index: u64) -> R<()> {
        let value = self.top()?;
        let n = self.memo.len() as u64;
        let max = self.budgets.max_memo;
        if index == n {
            if n + self.memo_sparse.len() as u64 >= max {
                return Err(Unsup);
            }
            self.memo.push(value);
            if !self.memo_sparse.is_empty() {
                self.memo_sparse.remove(&index);
            }
        } else if index < n {
            self.memo[index as usize] = value;
        } else {
            if !self.memo_sparse.contains_key(&index) && n + self.memo_sparse.len() as u64 >= max {
                return Err(Unsup);
            }
            self.memo_sparse.insert(index, value);
        }
        Ok(())
    }

    fn get(&mut self, index: u64) -> R<()> {
        let v = if index < self.memo.len() as u64 {
            self.memo[index as usize]
        } else {
            *self.memo_sparse.get(&index).ok_or(Unsup)?
        };
        self.push(v);
        Ok(())
    }

    /// vm.py's `check_key` + the reader's hooks, for the keys this VM stores: str and bytes
    /// (salted hashes: free), ints, bools and None (weighed; they cannot flood a hash: at most
    /// ten distinct 64-bit ints, None and bools share one), allowed globals (hashed by identity).
    /// Anything else (floats, tuples, records, containers) is the Python VM's business.
    fn check_key(&mut self, key: Val) -> R<()> {
        let weight = match key {
            Val::Str(_) | Val::Bytes(_) | Val::Global(_) => return Ok(()),
            Val::Int(v) => {
                let bits = 64 - v.unsigned_abs().leading_zeros() as u64;
                1 + (bits >> 6)
            }
            Val::Bool(_) | Val::None => 1,
            _ => return Err(Unsup),
        };
        self.key_work += weight;
        if self.key_work > self.max_key_work {
            return Err(Unsup);
        }
        Ok(())
    }

    /// `set_pairs` into a dict or OrderedDict node.
    fn set_pairs(&mut self, target: u32, items: &[Val]) -> R<()> {
        for pair in items.chunks(2) {
            self.check_key(pair[0])?;
        }
        match &mut self.nodes[target as usize] {
            Node::Dict(v) | Node::ODict(v, _) => v.extend_from_slice(items),
            _ => return Err(Unsup),
        }
        Ok(())
    }

    fn is_mapping(&self, v: Val) -> Option<u32> {
        match v {
            Val::Node(n) => match self.nodes[n as usize] {
                Node::Dict(_) | Node::ODict(..) => Some(n),
                _ => None,
            },
            _ => None,
        }
    }

    fn global(&mut self, module: &[u8], name: &[u8]) -> R<Val> {
        // global_name: charge(1, 64) before the lookup
        self.charge(1, 64)?;
        let key = (module.to_vec(), name.to_vec());
        if let Some(&id) = self.global_ids.get(&key) {
            return Ok(Val::Global(id));
        }
        let info = *self.config.names.get(&key).ok_or(Unsup)?;
        let id = u32::try_from(self.globals.len()).map_err(|_| Unsup)?;
        self.globals.push(key.clone());
        self.global_ids.insert(key, id);
        self.global_info.push(info);
        Ok(Val::Global(id))
    }

    /// A tuple's or a list's items (None for anything else).
    fn seq(&self, v: Val) -> Option<&[Val]> {
        match v {
            Val::EmptyTuple => Some(&[]),
            Val::Node(n) => match &self.nodes[n as usize] {
                Node::Tuple(start, len) => {
                    Some(&self.pool[*start as usize..*start as usize + *len as usize])
                }
                Node::List(v) => Some(v),
                _ => None,
            },
            _ => None,
        }
    }

    fn is_tuple(&self, v: Val) -> bool {
        match v {
            Val::EmptyTuple => true,
            Val::Node(n) => matches!(self.nodes[n as usize], Node::Tuple(..)),
            _ => false,
        }
    }

    /// A new tuple of `stack[k..]`, taken off the stack.
    fn tuple_from_stack(&mut self, k: usize) -> R<Val> {
        if k == self.stack.len() {
            return Ok(Val::EmptyTuple);
        }
        let start = u32::try_from(self.pool.len()).map_err(|_| Unsup)?;
        let len = u32::try_from(self.stack.len() - k).map_err(|_| Unsup)?;
        start.checked_add(len).ok_or(Unsup)?;
        self.pool.extend_from_slice(&self.stack[k..]);
        self.stack.truncate(k);
        self.node(Node::Tuple(start, len))
    }

    /// `v` if it is a tuple, else a new tuple of its items now (a list, which may change later).
    fn frozen(&mut self, v: Val) -> R<Val> {
        if self.is_tuple(v) {
            return Ok(v);
        }
        let items = self.seq(v).ok_or(Unsup)?.to_vec();
        let k = self.stack.len();
        self.stack.extend_from_slice(&items);
        self.tuple_from_stack(k)
    }

    /// `_as_int_tuple`'s check: a tuple or list of non-negative ints (not bools).
    fn int_tuple(&self, v: Val) -> R<usize> {
        let items = self.seq(v).ok_or(Unsup)?;
        if items.iter().all(|x| matches!(*x, Val::Int(i) if i >= 0)) {
            Ok(items.len())
        } else {
            Err(Unsup)
        }
    }

    fn is_empty_hooks(&self, v: Val) -> bool {
        match v {
            Val::EmptyHooks => true,
            Val::Node(n) => matches!(
                &self.nodes[n as usize],
                Node::ODict(items, NO_DICT) if items.is_empty()
            ),
            _ => false,
        }
    }

    /// `ReaderHooks.call` (REDUCE) for the builders this VM runs.
    fn call(&mut self, func: Val, args_val: Val) -> R<Val> {
        let g = match func {
            Val::Global(g) => g,
            _ => return Err(Unsup),
        };
        let info = self.global_info[g as usize];
        let is_tuple = self.is_tuple(args_val);
        let all = self.seq(args_val).ok_or(Unsup)?;
        if all.len() > 8 && info.kind != Kind::Reduce {
            return Err(Unsup);
        }
        let mut args = [Val::None; 8];
        args[..all.len().min(8)].copy_from_slice(&all[..all.len().min(8)]);
        let args = &args[..all.len().min(8)];
        match info.kind {
            Kind::Tensor(fixed) => {
                let f = fixed as usize;
                if args.len() != f && (f == 4 || args.len() != f + 1) {
                    return Err(Unsup);
                }
                let storage = match args[0] {
                    Val::Storage(s) => s,
                    _ => return Err(Unsup),
                };
                let offset = match args[1] {
                    Val::Int(i) if i >= 0 => i,
                    _ => return Err(Unsup),
                };
                let (shape, stride) = (args[2], args[3]);
                if self.int_tuple(shape)? != self.int_tuple(stride)? {
                    return Err(Unsup);
                }
                // a list is copied now (`tuple(value)`): appending to it later changes nothing
                let shape = self.frozen(shape)?;
                let stride = self.frozen(stride)?;
                let (requires_grad, hooks) = if f >= 6 {
                    let rg = match args[4] {
                        Val::Bool(b) => b,
                        _ => return Err(Unsup),
                    };
                    let h = if self.is_empty_hooks(args[5]) {
                        Val::EmptyHooks
                    } else {
                        args[5]
                    };
                    (rg, h)
                } else {
                    (false, Val::EmptyHooks)
                };
                let v3 = if f == 7 {
                    match args[6] {
                        Val::Global(d) if self.global_info[d as usize].dtype => Some(d),
                        _ => return Err(Unsup),
                    }
                } else {
                    None
                };
                let metadata = if args.len() > f { Some(args[f]) } else { None };
                let t = Tensor {
                    storage,
                    offset,
                    shape,
                    stride,
                    requires_grad,
                    hooks,
                    v3,
                    metadata,
                    param: None,
                };
                self.tensor(t)
            }
            Kind::Param(with_state) => {
                if args.len() != if with_state { 4 } else { 3 } {
                    return Err(Unsup);
                }
                let src = match args[0] {
                    Val::Node(n) => match self.nodes[n as usize] {
                        Node::Tensor(t) if self.tensors[t as usize].param.is_none() => {
                            &self.tensors[t as usize]
                        }
                        _ => return Err(Unsup),
                    },
                    _ => return Err(Unsup),
                };
                let t = Tensor {
                    storage: src.storage,
                    offset: src.offset,
                    shape: src.shape,
                    stride: src.stride,
                    requires_grad: src.requires_grad,
                    hooks: src.hooks,
                    v3: src.v3,
                    metadata: src.metadata,
                    param: Some(Box::new((
                        args[1],
                        args[2],
                        if with_state { Some(args[3]) } else { None },
                    ))),
                };
                self.tensor(t)
            }
            Kind::ODict => {
                if !args.is_empty() {
                    return Err(Unsup);
                }
                self.node(Node::ODict(Vec::new(), NO_DICT))
            }
            Kind::Other => Err(Unsup),
            Kind::Reduce => {
                // Reduce(func, args): the args tuple itself, or a new one made from a list
                let args = if is_tuple {
                    args_val
                } else {
                    let items = self.seq(args_val).ok_or(Unsup)?.to_vec();
                    let k = self.stack.len();
                    self.stack.extend_from_slice(&items);
                    self.tuple_from_stack(k)?
                };
                self.node(Node::Reduce { func: g, args })
            }
        }
    }

    /// `ReaderHooks.persistent_load` for `("storage", class, key, location, numel)`.
    fn persistent_load(&mut self, pid: Val) -> R<Val> {
        if !self.has_loader {
            return Err(Unsup);
        }
        if !self.is_tuple(pid) {
            return Err(Unsup);
        }
        let items = match self.seq(pid) {
            Some(v) if v.len() == 5 => [v[0], v[1], v[2], v[3], v[4]],
            _ => return Err(Unsup),
        };
        match items[0] {
            Val::Str(a) if self.text(a) == b"storage" => {}
            _ => return Err(Unsup),
        }
        let class = match items[1] {
            Val::Global(g) if self.global_info[g as usize].storage => g,
            _ => return Err(Unsup),
        };
        let (key, location) = match (items[2], items[3]) {
            (Val::Str(k), Val::Str(l)) => (k, l),
            _ => return Err(Unsup),
        };
        let numel = match items[4] {
            Val::Int(n) if n >= 0 => n,
            _ => return Err(Unsup),
        };
        let id = u32::try_from(self.pids.len()).map_err(|_| Unsup)?;
        self.pids.push((class, key, location, numel));
        Ok(Val::Storage(id))
    }

    /// BUILD: only an OrderedDict's `_metadata` (what `Module.state_dict()` pickles).
    fn build(&mut self, inst: Val, state: Val) -> R<()> {
        let target = match inst {
            Val::Node(n) if matches!(self.nodes[n as usize], Node::ODict(..)) => n,
            _ => return Err(Unsup),
        };
        let pairs = match state {
            Val::Node(n) => match &self.nodes[n as usize] {
                Node::Dict(v) => v.clone(),
                _ => return Err(Unsup),
            },
            _ => return Err(Unsup),
        };
        let mut value = None;
        for pair in pairs.chunks(2) {
            match pair[0] {
                Val::Str(a) if self.text(a) == b"_metadata" => value = Some(pair[1]),
                _ => return Err(Unsup),
            }
        }
        let slot = match value {
            Some(v) => {
                let i = u32::try_from(self.attrs.len()).map_err(|_| Unsup)?;
                if i >= EMPTY_DICT {
                    return Err(Unsup);
                }
                self.attrs.push(v);
                Some(i)
            }
            None => None,
        };
        if let Node::ODict(_, attr) = &mut self.nodes[target as usize] {
            match slot {
                Some(i) => *attr = i,
                None if *attr == NO_DICT => *attr = EMPTY_DICT,
                None => {}
            }
        }
        Ok(())
    }

    /// Run from `pos` to STOP: the root value and the offset after STOP.
    fn run(&mut self, mut pos: usize) -> R<(Val, usize)> {
        let d = self.data;
        while pos < self.end {
            let op = d[pos];
            pos += 1;
            match op {
                0x80 => {
                    // PROTO (any version: the reader takes up to 255)
                    pos = self.take(pos, 1)? + 1;
                }
                0x95 => {
                    // FRAME
                    pos = self.take(pos, 8)?;
                    let size = u64_at(d, pos);
                    pos += 8;
                    let in_frame = self.limit < self.end;
                    let fits = (pos as u64)
                        .checked_add(size)
                        .is_some_and(|s| s <= self.limit as u64);
                    if fits && in_frame {
                        continue;
                    }
                    if pos < self.limit && in_frame {
                        return Err(Unsup);
                    }
                    if size > (self.end - pos) as u64 {
                        return Err(Unsup);
                    }
                    self.limit = pos + size as usize;
                }
                b'.' => {
                    // the Python VM returns the bottom of the stack, CPython the top: only a
                    // stack of one item (what every pickler leaves) reads the same in both
                    if self.stack.len() != 1 || self.marks.len() != 1 {
                        return Err(Unsup);
                    }
                    if pos < self.limit && self.limit < self.end {
                        return Err(Unsup); // a frame's rest after STOP
                    }
                    let top = *self.stack.last().ok_or(Unsup)?;
                    return Ok((top, pos));
                }
                b'N' => self.push(Val::None),
                0x88 => self.push(Val::Bool(true)),
                0x89 => self.push(Val::Bool(false)),
                b'J' => {
                    pos = self.take(pos, 4)?;
                    self.push(Val::Int(u32_at(d, pos) as i32 as i64));
                    pos += 4;
                }
                b'K' => {
                    pos = self.take(pos, 1)?;
                    self.push(Val::Int(d[pos] as i64));
                    pos += 1;
                }
                b'M' => {
                    pos = self.take(pos, 2)?;
                    self.push(Val::Int(u16::from_le_bytes([d[pos], d[pos + 1]]) as i64));
                    pos += 2;
                }
                0x8a => {
                    // LONG1, up to 8 bytes (larger: the Python VM's big ints)
                    pos = self.take(pos, 1)?;
                    let size = d[pos] as usize;
                    pos = self.take(pos + 1, size)?;
                    if size > 8 {
                        return Err(Unsup);
                    }
                    let mut v: i64 = 0;
                    if size > 0 {
                        let mut b = [if d[pos + size - 1] & 0x80 != 0 {
                            0xff
                        } else {
                            0
                        }; 8];
                        b[..size].copy_from_slice(&d[pos..pos + size]);
                        v = i64::from_le_bytes(b);
                    }
                    self.push(Val::Int(v));
                    pos += size;
                }
                b'G' => {
                    pos = self.take(pos, 8)?;
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&d[pos..pos + 8]);
                    self.push(Val::Float(f64::from_be_bytes(b)));
                    pos += 8;
                }
                b'X' | b'T' => {
                    // BINUNICODE; BINSTRING (signed length; read as UTF-8 like the reader does)
                    pos = self.take(pos, 4)?;
                    let raw = u32_at(d, pos);
                    if op == b'T' && (raw as i32) < 0 {
                        return Err(Unsup);
                    }
                    let size = raw as usize;
                    pos = self.take(pos + 4, size)?;
                    self.push_str(pos, size)?;
                    pos += size;
                }
                0x8c | b'U' => {
                    pos = self.take(pos, 1)?;
                    let size = d[pos] as usize;
                    pos = self.take(pos + 1, size)?;
                    self.push_str(pos, size)?;
                    pos += size;
                }
                0x8d => {
                    pos = self.take(pos, 8)?;
                    let size = usize::try_from(u64_at(d, pos)).map_err(|_| Unsup)?;
                    pos = self.take(pos + 8, size)?;
                    self.push_str(pos, size)?;
                    pos += size;
                }
                b'B' => {
                    pos = self.take(pos, 4)?;
                    let size = u32_at(d, pos) as usize;
                    pos = self.push_bytes(pos + 4, size)?;
                }
                b'C' => {
                    pos = self.take(pos, 1)?;
                    let size = d[pos] as usize;
                    pos = self.push_bytes(pos + 1, size)?;
                }
                0x8e => {
                    pos = self.take(pos, 8)?;
                    let size = usize::try_from(u64_at(d, pos)).map_err(|_| Unsup)?;
                    pos = self.push_bytes(pos + 8, size)?;
                }
                b'(' => self.marks.push(self.stack.len()),
                b')' => self.push(Val::EmptyTuple),
                b't' => {
                    if self.marks.len() == 1 {
                        return Err(Unsup);
                    }
                    let k = self.marks.pop().ok_or(Unsup)?;
                    self.charge(1, 40 + 8 * (self.stack.len() - k) as u64)?;
                    let v = self.tuple_from_stack(k)?;
                    self.push(v);
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < self.floor() + n {
                        return Err(Unsup);
                    }
                    self.charge(1, 40 + 8 * n as u64)?;
                    let v = self.tuple_from_stack(self.stack.len() - n)?;
                    self.push(v);
                }
                b']' => {
                    self.charge(1, 56)?;
                    let v = self.node(Node::List(Vec::new()))?;
                    self.push(v);
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.charge(1, 56 + 8 * items.len() as u64)?;
                    let v = self.node(Node::List(items))?;
                    self.push(v);
                }
                b'}' => {
                    self.charge(1, 64)?;
                    let v = self.node(Node::Dict(Vec::new()))?;
                    self.push(v);
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    if items.len() % 2 != 0 {
                        return Err(Unsup);
                    }
                    self.charge(1, 64 + 40 * items.len() as u64)?;
                    let v = self.node(Node::Dict(Vec::new()))?;
                    let Val::Node(n) = v else { return Err(Unsup) };
                    self.set_pairs(n, &items)?;
                    self.push(v);
                }
                b'a' => {
                    let value = self.pop()?;
                    let target = self.top()?;
                    self.charge(0, 8)?;
                    match target {
                        Val::Node(n) => match &mut self.nodes[n as usize] {
                            Node::List(v) => v.push(value),
                            _ => return Err(Unsup),
                        },
                        _ => return Err(Unsup),
                    }
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    self.charge(0, 8 * items.len() as u64)?;
                    match target {
                        Val::Node(n) => match &mut self.nodes[n as usize] {
                            Node::List(v) => v.extend_from_slice(&items),
                            _ => return Err(Unsup),
                        },
                        _ => return Err(Unsup),
                    }
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let target = self.top()?;
                    self.charge(0, 40)?;
                    let n = self.is_mapping(target).ok_or(Unsup)?;
                    self.set_pairs(n, &[key, value])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    if items.len() % 2 != 0 {
                        return Err(Unsup);
                    }
                    let target = self.top()?;
                    self.charge(0, 40 * items.len() as u64)?;
                    let n = self.is_mapping(target).ok_or(Unsup)?;
                    self.set_pairs(n, &items)?;
                }
                b'0' => {
                    if self.marks.len() > 1 && self.stack.len() == self.floor() {
                        self.marks.pop();
                    } else {
                        self.pop()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?;
                    self.push(v);
                }
                b'q' => {
                    pos = self.take(pos, 1)?;
                    self.put(d[pos] as u64)?;
                    pos += 1;
                }
                b'r' => {
                    pos = self.take(pos, 4)?;
                    self.put(u32_at(d, pos) as u64)?;
                    pos += 4;
                }
                0x94 => {
                    let index = self.memo.len() as u64 + self.memo_sparse.len() as u64;
                    self.put(index)?;
                }
                b'h' => {
                    pos = self.take(pos, 1)?;
                    self.get(d[pos] as u64)?;
                    pos += 1;
                }
                b'j' => {
                    pos = self.take(pos, 4)?;
                    self.get(u32_at(d, pos) as u64)?;
                    pos += 4;
                }
                b'c' => {
                    let (ms, me, next) = self.line(pos)?;
                    let (ns, ne, next) = self.line(next)?;
                    pos = next;
                    let (module, name) = (&d[ms..me], &d[ns..ne]);
                    if std::str::from_utf8(module).is_err() || std::str::from_utf8(name).is_err() {
                        return Err(Unsup);
                    }
                    let g = self.global(module, name)?;
                    self.push(g);
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Val::Str(m), Val::Str(n)) = (module, name) else {
                        return Err(Unsup);
                    };
                    let g = self.global(self.text(m), self.text(n))?;
                    self.push(g);
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.top()?;
                    self.seq(args).ok_or(Unsup)?;
                    self.charge(1, 64)?;
                    let v = self.call(func, args)?;
                    let last = self.stack.len() - 1;
                    self.stack[last] = v;
                }
                0x81 => {
                    // NEWOBJ: OrderedDict.__new__ (its arguments ignored, as torch calls it)
                    let args = self.pop()?;
                    let cls = self.top()?;
                    self.seq(args).ok_or(Unsup)?;
                    self.charge(1, 64)?;
                    match cls {
                        Val::Global(g) if self.global_info[g as usize].kind == Kind::ODict => {}
                        _ => return Err(Unsup),
                    }
                    let v = self.node(Node::ODict(Vec::new(), NO_DICT))?;
                    let last = self.stack.len() - 1;
                    self.stack[last] = v;
                }
                b'b' => {
                    let state = self.pop()?;
                    let inst = self.top()?;
                    self.build(inst, state)?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_load(pid)?;
                    self.push(v);
                }
                _ => return Err(Unsup),
            }
        }
        Err(Unsup) // truncated
    }
}

// ------------------------------------------------------------------------------------ output

/// A pickle writer for the output (protocol 4 opcodes, no GLOBAL).
struct Out {
    buf: Vec<u8>,
    memo: u32,
}

impl Out {
    fn op(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    fn int(&mut self, v: i64) {
        if (0..256).contains(&v) {
            self.buf.extend_from_slice(&[b'K', v as u8]);
        } else if (0..65536).contains(&v) {
            self.buf.push(b'M');
            self.buf.extend_from_slice(&(v as u16).to_le_bytes());
        } else if (i32::MIN as i64..=i32::MAX as i64).contains(&v) {
            self.buf.push(b'J');
            self.buf.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            self.buf.extend_from_slice(&[0x8a, 8]);
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
    }
    fn pid(&mut self, p: u64) {
        self.int(p as i64);
        self.buf.push(b'Q');
    }
    fn str(&mut self, s: &[u8]) {
        if s.len() < 256 {
            self.buf.extend_from_slice(&[0x8c, s.len() as u8]);
        } else if let Ok(n) = u32::try_from(s.len()) {
            self.buf.push(b'X');
            self.buf.extend_from_slice(&n.to_le_bytes());
        } else {
            self.buf.push(0x8d);
            self.buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        }
        self.buf.extend_from_slice(s);
    }
    fn bytes(&mut self, s: &[u8]) {
        if s.len() < 256 {
            self.buf.extend_from_slice(&[b'C', s.len() as u8]);
        } else if let Ok(n) = u32::try_from(s.len()) {
            self.buf.push(b'B');
            self.buf.extend_from_slice(&n.to_le_bytes());
        } else {
            self.buf.push(0x8e);
            self.buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        }
        self.buf.extend_from_slice(s);
    }
    /// LONG_BINPUT the top; returns its memo index
    fn put(&mut self) -> u32 {
        let i = self.memo;
        self.memo += 1;
        self.buf.push(b'r');
        self.buf.extend_from_slice(&i.to_le_bytes());
        i
    }
    fn get(&mut self, i: u32) {
        if i < 256 {
            self.buf.extend_from_slice(&[b'h', i as u8]);
        } else {
            self.buf.push(b'j');
            self.buf.extend_from_slice(&i.to_le_bytes());
        }
    }
    /// a pickle of protocol 4 in one FRAME, from the opcodes in `body` (ending with STOP)
    fn framed(body: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(body.len() + 11);
        v.extend_from_slice(&[0x80, 4, 0x95]);
        v.extend_from_slice(&(body.len() as u64).to_le_bytes());
        v.extend_from_slice(body);
        v
    }
}

#[derive(Clone, Copy)]
enum Task {
    Val(Val),
    /// the remaining children of a container node, from this index
    Seq(u32, u32),
    /// a node's next stage (per kind: see `Emitter::stage`)
    Stage(u32, u8),
}

const NOT_SEEN: u32 = u32::MAX;
const IN_PROGRESS: u32 = u32::MAX - 1;
/// written once and not memoized (the count said it is reached once)
const WRITTEN: u32 = u32::MAX - 2;

struct Emitter<'v, 'a> {
    vm: &'v Vm<'a>,
    out: Out,
    tasks: Vec<Task>,
    /// references to each node / atom in the output tree (only "more than one" matters)
    node_refs: Vec<u8>,
    atom_refs: Vec<u8>,
    /// output memo index of each node / atom once written (or NOT_SEEN / IN_PROGRESS)
    node_memo: Vec<u32>,
    atom_memo: Vec<u32>,
    slot_memo: [u32; SLOTS.len()],
    /// tensor shapes and strides, one tuple per distinct value (as `_SHAPES` shares them)
    shapes: HashMap<Vec<i64>, u32>,
    tmp: Vec<i64>,
    storage_base: u64,
    dtype_base: u64,
    /// the dtype name of each v3 dtype global, memoized
    dtype_memo: HashMap<u32, u32>,
}

impl<'v, 'a> Emitter<'v, 'a> {
    /// Push the values node `n` writes (its children in the output) onto `todo`.
    fn children(vm: &Vm, n: u32, todo: &mut Vec<Val>) {
        match &vm.nodes[n as usize] {
            Node::Tuple(..) | Node::List(_) => {
                todo.extend_from_slice(vm.seq(Val::Node(n)).unwrap_or(&[]))
            }
            Node::Dict(v) => todo.extend_from_slice(v),
            Node::ODict(items, attr) => {
                todo.extend_from_slice(items);
                todo.extend(vm.attrs.get(*attr as usize).copied());
            }
            Node::Tensor(t) => {
                let t = &vm.tensors[*t as usize];
                todo.push(t.hooks);
                todo.extend(t.metadata.iter().copied());
                if let Some((a, b, c)) = t.param.as_deref().copied() {
                    todo.push(a);
                    todo.push(b);
                    todo.extend(c.iter().copied());
                }
            }
            Node::Reduce { args, .. } => todo.push(*args),
        }
    }

    /// Count references (saturating at 2) over everything reachable from `root`.
    fn count(&mut self, root: Val) {
        let mut todo = vec![root];
        while let Some(v) = todo.pop() {
            match v {
                Val::Node(n) => {
                    let c = &mut self.node_refs[n as usize];
                    *c = c.saturating_add(1);
                    if *c == 1 {
                        Self::children(self.vm, n, &mut todo);
                    }
                }
                Val::Str(a) | Val::Bytes(a) => {
                    let c = &mut self.atom_refs[a as usize];
                    *c = c.saturating_add(1);
                }
                _ => {}
            }
        }
    }

    fn slot(&mut self, s: usize) {
        self.out.get(self.slot_memo[s]);
    }

    /// Write a value that is not a node at once; a node's work goes on the task stack.
    fn val(&mut self, v: Val) -> R<()> {
        match v {
            Val::None => self.out.op(b"N"),
            Val::Bool(true) => self.out.op(&[0x88]),
            Val::Bool(false) => self.out.op(&[0x89]),
            Val::Int(i) => self.out.int(i),
            Val::Float(f) => {
                self.out.op(b"G");
                self.out.op(&f.to_be_bytes());
            }
            Val::Str(a) | Val::Bytes(a) => {
                let m = self.atom_memo[a as usize];
                if m != NOT_SEEN {
                    self.out.get(m);
                    return Ok(());
                }
                let text = self.vm.text(a);
                if matches!(v, Val::Str(_)) {
                    self.out.str(text);
                } else {
                    self.out.bytes(text);
                }
                if self.atom_refs[a as usize] > 1 {
                    self.atom_memo[a as usize] = self.out.put();
                }
            }
            Val::EmptyTuple => self.out.op(b")"),
            Val::Global(g) => self.out.pid(PID_GLOBALS + g as u64),
            Val::Storage(s) => self.out.pid(self.storage_base + s as u64),
            Val::EmptyHooks => self.out.pid(PID_EMPTY_HOOKS),
            Val::Node(n) => {
                let m = self.node_memo[n as usize];
                if m == IN_PROGRESS || m == WRITTEN {
                    return Err(Unsup); // a cycle: the Python VM builds those (WRITTEN: never, by the count)
                }
                if m != NOT_SEEN {
                    self.out.get(m);
                    return Ok(());
                }
                self.node_memo[n as usize] = IN_PROGRESS;
                self.tasks.push(Task::Stage(n, 0));
            }
        }
        Ok(())
    }

    fn finish(&mut self, n: u32) {
        self.node_memo[n as usize] = if self.node_refs[n as usize] > 1 {
            self.out.put()
        } else {
            WRITTEN
        };
    }

    /// A tensor's size or stride, checked by the VM (ints >= 0), as a tuple shared by value.
    fn int_tuple(&mut self, v: Val) {
        let items = self.vm.seq(v).unwrap_or(&[]);
        if items.is_empty() {
            self.out.op(b")");
            return;
        }
        self.tmp.clear();
        self.tmp.extend(
            items
                .iter()
                .map(|x| if let Val::Int(i) = x { *i } else { 0 }),
        );
        if let Some(&m) = self.shapes.get(self.tmp.as_slice()) {
            self.out.get(m);
            return;
        }
        self.out.op(b"(");
        for &i in &self.tmp {
            self.out.int(i);
        }
        self.out.op(b"t");
        if self.shapes.len() < MAX_SHAPES && self.tmp.len() <= 8 {
            let m = self.out.put();
            self.shapes.insert(self.tmp.clone(), m);
        }
    }

    /// One step of a node's output; pushes what comes next (its stage, then its children).
    fn stage(&mut self, n: u32, stage: u8) -> R<()> {
        let vm = self.vm;
        match &vm.nodes[n as usize] {
            Node::Tuple(..) | Node::List(_) | Node::Dict(_) => {
                if stage == 0 {
                    self.out.op(b"(");
                    self.tasks.push(Task::Stage(n, 1));
                    self.tasks.push(Task::Seq(n, 0));
                } else {
                    self.out.op(match &vm.nodes[n as usize] {
                        Node::Tuple(..) => b"t",
                        Node::List(_) => b"l",
                        _ => b"d",
                    });
                    self.finish(n);
                }
            }
            Node::ODict(_, attr) => match stage {
                0 => {
                    self.out.pid(PID_ODICT);
                    self.out.op(b")\x81(");
                    self.tasks.push(Task::Stage(n, 1));
                    self.tasks.push(Task::Seq(n, 0));
                }
                1 => {
                    self.out.op(b"u");
                    match *attr {
                        NO_DICT => self.finish(n),
                        EMPTY_DICT => {
                            self.out.op(b"}b");
                            self.finish(n);
                        }
                        i => {
                            self.out.op(b"}(");
                            self.out.str(b"_metadata");
                            self.tasks.push(Task::Stage(n, 2));
                            self.tasks.push(Task::Val(vm.attrs[i as usize]));
                        }
                    }
                }
                _ => {
                    self.out.op(b"ub");
                    self.finish(n);
                }
            },
            Node::Reduce { func, args } => {
                // Reduce(func, args): its __init__ called by REDUCE
                if stage == 0 {
                    self.out.pid(PID_REDUCE);
                    self.out.op(b"(");
                    self.out.pid(PID_GLOBALS + *func as u64);
                    self.tasks.push(Task::Stage(n, 1));
                    self.tasks.push(Task::Val(*args));
                } else {
                    self.out.op(b"tR");
                    self.finish(n);
                }
            }
            Node::Tensor(ti) => {
                let t = &vm.tensors[*ti as usize];
                self.tensor_stage(n, t, stage);
            }
        }
        Ok(())
    }

    /// A tensor's stages: the record's slots, with its hooks, metadata and ParamInfo values between.
    fn tensor_stage(&mut self, n: u32, t: &Tensor, stage: u8) {
        let vm = self.vm;
        // TensorRef(storage, storage_offset, shape, stride, dtype, requires_grad, hooks, rebuild,
        // dtype_global, metadata, param): the dataclass's own __init__, called by REDUCE (measured:
        // 3x faster than NEWOBJ + BUILD of its slots)
        match stage {
            0 => {
                self.out.pid(PID_TENSOR);
                self.out.op(b"(");
                self.out.pid(self.storage_base + t.storage as u64);
                self.out.int(t.offset);
                self.int_tuple(t.shape);
                self.int_tuple(t.stride);
                match t.v3 {
                    None => self.out.pid(self.dtype_base + t.storage as u64),
                    Some(g) => match self.dtype_memo.get(&g) {
                        Some(&m) => self.out.get(m),
                        None => {
                            let name = vm.globals[g as usize].1.clone();
                            self.out.str(&name);
                            let m = self.out.put();
                            self.dtype_memo.insert(g, m);
                        }
                    },
                }
                self.out.op(if t.requires_grad { &[0x88] } else { &[0x89] });
                self.tasks.push(Task::Stage(n, 1));
                self.tasks.push(Task::Val(t.hooks));
            }
            1 => {
                self.slot(if t.v3.is_some() { 1 } else { 0 });
                match t.v3 {
                    None => self.out.op(b"N"),
                    Some(g) => self.out.pid(PID_GLOBALS + g as u64),
                }
                self.tasks.push(Task::Stage(n, 2));
                match t.metadata {
                    None => self.out.pid(PID_ABSENT),
                    Some(v) => self.tasks.push(Task::Val(v)),
                }
            }
            2 => match t.param.as_deref().copied() {
                None => {
                    self.out.op(b"NtR");
                    self.finish(n);
                }
                Some((a, b, c)) => {
                    // ParamInfo(requires_grad, hooks, state)
                    self.out.pid(PID_PARAMINFO);
                    self.out.op(b"(");
                    self.tasks.push(Task::Stage(n, 3));
                    match c {
                        None => self.tasks.push(Task::Stage(n, 4)),
                        Some(c) => self.tasks.push(Task::Val(c)),
                    }
                    self.tasks.push(Task::Val(b));
                    self.tasks.push(Task::Val(a));
                }
            },
            3 => {
                self.out.op(b"tRtR");
                self.finish(n);
            }
            _ => self.out.pid(PID_ABSENT), // ParamInfo's state when the pickle gave none
        }
    }

    fn seq(&mut self, n: u32, i: u32) {
        let vm = self.vm;
        let items: &[Val] = match &vm.nodes[n as usize] {
            Node::Tuple(..) | Node::List(_) => vm.seq(Val::Node(n)).unwrap_or(&[]),
            Node::Dict(v) => v,
            Node::ODict(items, _) => items,
            _ => &[],
        };
        if let Some(&v) = items.get(i as usize) {
            self.tasks.push(Task::Seq(n, i + 1));
            self.tasks.push(Task::Val(v));
        }
    }

    fn emit(&mut self, root: Val) -> R<()> {
        for (i, name) in SLOTS.iter().enumerate() {
            self.out.str(name.as_bytes());
            self.slot_memo[i] = self.out.put();
            self.out.op(b"0");
        }
        self.tasks.push(Task::Val(root));
        while let Some(task) = self.tasks.pop() {
            match task {
                Task::Val(v) => self.val(v)?,
                Task::Seq(n, i) => self.seq(n, i),
                Task::Stage(n, s) => self.stage(n, s)?,
            }
        }
        self.out.op(b".");
        Ok(())
    }
}

/// The meta pickle: `(end, [(module, name)...], kinds, keys, locations, numels)`.
fn meta(vm: &Vm, end: usize) -> Vec<u8> {
    let mut o = Out {
        buf: Vec::new(),
        memo: 0,
    };
    o.op(b"(");
    o.int(i64::try_from(end).unwrap_or(i64::MAX));
    o.op(b"(");
    for (m, n) in &vm.globals {
        o.str(m);
        o.str(n);
        o.op(&[0x86]);
    }
    o.op(b"l(");
    for p in &vm.pids {
        o.int(p.0 as i64);
    }
    o.op(b"l(");
    for p in &vm.pids {
        o.str(vm.text(p.1));
    }
    o.op(b"l(");
    let mut locations: HashMap<&[u8], u32> = HashMap::new();
    for p in &vm.pids {
        let text = vm.text(p.2);
        match locations.get(text) {
            Some(&m) => o.get(m),
            None => {
                o.str(text);
                let m = o.put();
                locations.insert(text, m);
            }
        }
    }
    o.op(b"l(");
    for p in &vm.pids {
        o.int(p.3);
    }
    o.op(b"lt.");
    Out::framed(&o.buf)
}

/// Read the pickle at `data[start..end]`; `Ok(None)` leaves it to the Python VM.
pub fn load(
    data: &[u8],
    start: usize,
    end: usize,
    config: &Config,
    budgets: Budgets,
    has_loader: bool,
) -> Option<Vec<u8>> {
    load_with(data, start, end, config, budgets, has_loader, false)
}

/// [`load`], and with `checks` the meta pickle carries three more items: the tensor columns
/// the extent check needs and the nesting bound (see `vm_checks.rs`).
pub fn load_with(
    data: &[u8],
    start: usize,
    end: usize,
    config: &Config,
    budgets: Budgets,
    has_loader: bool,
    checks: bool,
) -> Option<Vec<u8>> {
    if start > end || end > data.len() {
        return None;
    }
    let length = (end - start) as u64;
    let mut vm = Vm {
        data,
        end,
        limit: end,
        budgets,
        objects: 0,
        alloc: 0,
        key_work: 0,
        max_key_work: (1u64 << 22).saturating_add(length.saturating_mul(16)),
        // reserved from the length (torch.save writes ~1 memo entry per 8 bytes, a node per 16, a
        // tuple item per 6): growing by doubling would copy -- and touch -- each array twice
        stack: Vec::new(),
        marks: vec![0],
        memo: Vec::with_capacity((end - start) / 8),
        memo_sparse: HashMap::new(),
        atoms: Vec::with_capacity((end - start) / 40),
        nodes: Vec::with_capacity((end - start) / 16),
        pool: Vec::with_capacity((end - start) / 6),
        tensors: Vec::with_capacity((end - start) / 90),
        attrs: Vec::new(),
        config,
        globals: Vec::new(),
        global_ids: HashMap::new(),
        global_info: Vec::new(),
        pids: Vec::new(),
        has_loader,
    };
    let (root, stop) = vm.run(start).ok()?;
    // the memo and the stack serve only the run (the output is written from the nodes): freed
    // before the emitter's arrays and output are made (22 MB of the 200 000-tensor read's peak)
    vm.memo = Vec::new();
    vm.memo_sparse = HashMap::new();
    vm.stack = Vec::new();
    let mut head = meta(&vm, stop);
    if checks {
        // before the emitter's arrays and output exist: the VM's are at their largest here
        head = checks::extend_meta(&vm, &head, root)?;
    }
    let storage_base = PID_GLOBALS + vm.globals.len() as u64;
    // the output in one buffer: the meta pickle, then the tree pickle's FRAME header (its length
    // patched in below) and its body written in place -- not framed and appended afterwards,
    // which made two more copies of the largest thing the VM returns (12 MB at 200 000 tensors)
    let body_at = head.len() + 11;
    let mut buf = Vec::with_capacity(body_at.saturating_add(data.len().saturating_mul(3) / 2));
    buf.extend_from_slice(&head);
    buf.extend_from_slice(&[0x80, 4, 0x95, 0, 0, 0, 0, 0, 0, 0, 0]);
    drop(head);
    let mut em = Emitter {
        vm: &vm,
        out: Out { buf, memo: 0 },
        tasks: Vec::new(),
        node_refs: vec![0; vm.nodes.len()],
        atom_refs: vec![0; vm.atoms.len()],
        node_memo: vec![NOT_SEEN; vm.nodes.len()],
        atom_memo: vec![NOT_SEEN; vm.atoms.len()],
        slot_memo: [0; SLOTS.len()],
        shapes: HashMap::new(),
        tmp: Vec::new(),
        storage_base,
        dtype_base: storage_base + vm.pids.len() as u64,
        dtype_memo: HashMap::new(),
    };
    em.count(root);
    em.emit(root).ok()?;
    let mut result = std::mem::take(&mut em.out.buf);
    let body_len = (result.len() - body_at) as u64;
    result[body_at - 8..body_at].copy_from_slice(&body_len.to_le_bytes());
    Some(result)
}

/// `ckptfix_vm_load`: see [`load`]. `config` is the allow-list table; `budgets` points to three
/// u64 (max_objects, max_alloc, max_memo).
///
/// # Safety
/// Every (pointer, length) pair must be valid for reads during the call, `budgets` must point
/// to three u64, and `out` must be valid for one write (the `ffi` conventions).
#[no_mangle]
pub unsafe extern "C" fn ckptfix_vm_load(
    data: *const u8,
    data_len: usize,
    start: usize,
    end: usize,
    config: *const u8,
    config_len: usize,
    budgets: *const u64,
    has_loader: i32,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        vm_call(
            data, data_len, start, end, config, config_len, budgets, has_loader, false, out,
        )
    }
}

/// `ckptfix_vm_read`: [`ckptfix_vm_load`] whose meta pickle also carries the extent-check
/// columns and the nesting bound ([`load_with`] with `checks`). Same arguments.
///
/// # Safety
/// As [`ckptfix_vm_load`].
#[no_mangle]
pub unsafe extern "C" fn ckptfix_vm_read(
    data: *const u8,
    data_len: usize,
    start: usize,
    end: usize,
    config: *const u8,
    config_len: usize,
    budgets: *const u64,
    has_loader: i32,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        vm_call(
            data, data_len, start, end, config, config_len, budgets, has_loader, true, out,
        )
    }
}

/// The two exports' one body: the C arguments as slices, then [`load_with`].
///
/// # Safety
/// As [`ckptfix_vm_load`].
#[allow(clippy::too_many_arguments)]
unsafe fn vm_call(
    data: *const u8,
    data_len: usize,
    start: usize,
    end: usize,
    config: *const u8,
    config_len: usize,
    budgets: *const u64,
    has_loader: i32,
    checks: bool,
    out: *mut crate::ffi::OutBuf,
) -> i32 {
    // SAFETY: the caller's contract (ffi conventions): valid for the call.
    let data = unsafe { crate::ffi::input(data, data_len) };
    // SAFETY: as above.
    let config = unsafe { crate::ffi::input(config, config_len) };
    // SAFETY: `budgets` points to three u64 (the caller's contract).
    let limits = unsafe { crate::ffi::input(budgets as *const u8, 24) };
    // SAFETY: `out` is the caller's out-parameter.
    unsafe {
        crate::ffi::guard(out, move || {
            let budgets = checks::budgets(limits);
            let config = Config::parse(config)
                .ok_or_else(|| "native VM: malformed allow-list table".to_string())?;
            Ok(load_with(
                data,
                start,
                end,
                &config,
                budgets,
                has_loader != 0,
                checks,
            ))
        })
    }
}

const _: () = assert!(std::mem::size_of::<Node>() <= 32 && std::mem::size_of::<Val>() <= 16);

#[path = "vm_checks.rs"]
mod checks;
pub use checks::ckptfix_vm_extents;

#[cfg(test)]
#[path = "vm_tests.rs"]
mod tests;
