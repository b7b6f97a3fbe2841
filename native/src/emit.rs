//! The torch-layout pickle emitter: `ckptfix/pickling/writer.py`'s `dumps`, byte for byte.
//!
//! Input is an [`Arena`]: the checkpoint tree as flat columns -- containers as spans of values,
//! tensors and storages as records, strings in one byte buffer -- with one node per distinct
//! Python object (identity kept, so shared objects and cycles are what they were). `emit_py`
//! fills it from the live Python tree through the C API; tests fill it by hand.
//!
//! The Python emitter is the reference and this module mirrors it step for step: the same work
//! stack of pending values, raw opcodes and "then" steps, the same memo (containers and records by
//! identity, strings of up to 40 bytes by value, globals by full name, one index counter), the
//! same tensor fast path, the same batching. Which objects are memoized depends on the
//! `shared` set, which `dumps` computes with `model/walk.py`'s walk; [`shared_nodes`] replays
//! that walk over the arena (same children, same order, same nesting limit).
//!
//! Anything whose bytes would depend on more than this mirrors -- a memo slot written twice, a
//! nesting deeper than the walk allows, an emission that does not end -- is
//! [`Unsupported`]: the Python emitter then runs and gives its own answer (or error).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The walk's (and reader's) nesting limit: `model/walk.py` MAX_NESTING.
pub const MAX_NESTING: usize = 1000;
/// Items per SETITEMS/APPENDS, as pickle batches them (writer.py `_BATCH`).
const BATCH: usize = 1000;
/// Strings up to this many UTF-8 bytes are memoized by value (writer.py `_MEMO_STR`).
const MEMO_STR: usize = 40;

/// This tree (or this part of it) is left to the Python emitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsupported;

/// One value in the tree: an atom written inline, or a node of the arena.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Val {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// index into [`Arena::strs`]
    Str(u32),
    /// index into [`Arena::globals`]
    Global(u32),
    /// `refs.EMPTY_HOOKS`: written as `OrderedDict()`
    EmptyHooks,
    /// `refs.ABSENT`: only in the slots that may hold it (metadata, states)
    Absent,
    /// index into [`Arena::nodes`]
    Node(u32),
}

/// A span of [`Arena::vals`] (dict items are key, value, key, value...).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Span {
    pub start: u32,
    pub len: u32,
}

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

/// `refs.ParamInfo`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Param {
    pub requires_grad: Val,
    pub hooks: Val,
    pub state: Val,
}

/// `refs.TensorRef`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// a [`Node::Storage`]
    pub storage: u32,
    /// its [`TensorVals`]: an index into [`Arena::tensor_vals`] (see [`Arena::add_tensor`])
    pub vals: u32,
    pub offset: i64,
    /// spans of [`Arena::ints`]
    pub shape: Span,
    pub stride: Span,
    /// `rebuild == "v3"`
    pub v3: bool,
    /// boxed: most tensors are not parameters (keeps the column at 48 B a tensor)
    pub param: Option<Box<Param>>,
}

/// A tensor's field values other than its storage and geometry: nearly every tensor of a
/// checkpoint has the same four (`False`, the empty hooks, `None` or one dtype, no metadata),
/// so a run of equal ones is kept once ([`Arena::add_tensor`]): 64 bytes a tensor less.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TensorVals {
    pub requires_grad: Val,
    pub hooks: Val,
    pub dtype_global: Val,
    pub metadata: Val,
}

/// One distinct object of the tree.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// made but not filled yet (the builder fills every node before emitting)
    Pending,
    Dict(Span),
    /// items, and the non-empty `__dict__` (a [`Node::Dict`]) if any
    OrderedDict(Span, Option<Val>),
    List(Span),
    Tuple(Span),
    /// index into [`Arena::tensors`]
    Tensor(u32),
    Storage {
        storage_type: u32,
        location: u32,
        numel: i64,
    },
    /// `refs.Reduce`: func (a global), args (a [`Node::Tuple`]), state
    Reduce {
        func: u32,
        args: u32,
        state: Val,
    },
}

/// A global's two halves (its memo key is `module.name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalName {
    pub module: String,
    pub name: String,
}

/// The globals the emitter writes itself, at these indices of every arena (see [`Arena::new`]).
pub const ORDERED_DICT: u32 = 0;
const REBUILD_V2: u32 = 1;
const REBUILD_V3: u32 = 2;
const REBUILD_PARAM: u32 = 3;
const REBUILD_PARAM_STATE: u32 = 4;
const OWN_GLOBALS: [(&str, &str); 5] = [
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
];
/// The string every storage's persistent id starts with: string 0 of every arena.
const STORAGE_WORD: u32 = 0;

/// A fast hasher (FxHash's step) for the memo's keys: short strings and object addresses.
#[derive(Default)]
pub struct FastHasher(u64);

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let mut word = [0u8; 8];
        word[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        self.add(u64::from_le_bytes(word));
    }
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// The tree as columns.
#[derive(Debug, Default)]
pub struct Arena {
    pub nodes: Vec<Node>,
    pub vals: Vec<Val>,
    pub ints: Vec<i64>,
    pub tensors: Vec<Tensor>,
    /// the tensors' [`TensorVals`], each run of equal ones once
    pub tensor_vals: Vec<TensorVals>,
    pub text: Vec<u8>,
    /// (start, len) into `text`
    pub strs: Vec<(usize, usize)>,
    pub globals: Vec<GlobalName>,
    /// `module.name` -> index in `globals` (the Python emitter's memo is by full name)
    global_index: HashMap<String, u32>,
}

impl Arena {
    /// An empty arena holding what the emitter writes itself: the "storage" word (string 0)
    /// and its own globals (0 to 4).
    pub fn new() -> Arena {
        let mut arena = Arena::default();
        arena.text.extend_from_slice(b"storage");
        arena.strs.push((0, 7));
        for (module, name) in OWN_GLOBALS {
            arena.globals.push(GlobalName {
                module: module.to_string(),
                name: name.to_string(),
            });
            arena
                .global_index
                .insert(format!("{module}.{name}"), arena.globals.len() as u32 - 1);
        }
        arena
    }

    pub fn str_bytes(&self, index: u32) -> &[u8] {
        let (start, len) = self.strs[index as usize];
        &self.text[start..start + len]
    }

    pub fn add_str(&mut self, bytes: &[u8]) -> Result<Val, Unsupported> {
        let index = u32::try_from(self.strs.len()).map_err(|_| Unsupported)?;
        self.strs.push((self.text.len(), bytes.len()));
        self.text.extend_from_slice(bytes);
        Ok(Val::Str(index))
    }

    /// A global, checked as writer.py's `global_` checks it before writing: a dotted ASCII name.
    pub fn add_global(&mut self, module: &str, name: &str) -> Result<Val, Unsupported> {
        let full = format!("{module}.{name}");
        if let Some(&index) = self.global_index.get(&full) {
            let known = &self.globals[index as usize];
            if known.module != module || known.name != name {
                return Err(Unsupported); // one full name split two ways: which is written first?
            }
            return Ok(Val::Global(index));
        }
        if !is_dotted_identifier(&full) {
            return Err(Unsupported); // the Python emitter refuses it with its own message
        }
        let index = u32::try_from(self.globals.len()).map_err(|_| Unsupported)?;
        self.globals.push(GlobalName {
            module: module.to_string(),
            name: name.to_string(),
        });
        self.global_index.insert(full, index);
        Ok(Val::Global(index))
    }

    pub fn add_node(&mut self, node: Node) -> Result<u32, Unsupported> {
        let index = u32::try_from(self.nodes.len()).map_err(|_| Unsupported)?;
        self.nodes.push(node);
        Ok(index)
    }

    pub fn add_vals(&mut self, vals: &[Val]) -> Result<Span, Unsupported> {
        let start = u32::try_from(self.vals.len()).map_err(|_| Unsupported)?;
        let len = u32::try_from(vals.len()).map_err(|_| Unsupported)?;
        start.checked_add(len).ok_or(Unsupported)?;
        self.vals.extend_from_slice(vals);
        Ok(Span { start, len })
    }

    pub fn add_ints(&mut self, ints: &[i64]) -> Result<Span, Unsupported> {
        let start = u32::try_from(self.ints.len()).map_err(|_| Unsupported)?;
        let len = u32::try_from(ints.len()).map_err(|_| Unsupported)?;
        start.checked_add(len).ok_or(Unsupported)?;
        self.ints.extend_from_slice(ints);
        Ok(Span { start, len })
    }

    /// The ints of a span made by [`Arena::add_ints`].
    pub fn ints_of(&self, span: Span) -> &[i64] {
        &self.ints[span.range()]
    }

    pub fn add_tensor(&mut self, tensor: Tensor, vals: TensorVals) -> Result<u32, Unsupported> {
        let index = self.push_tensor(tensor, vals)?;
        self.add_node(Node::Tensor(index))
    }

    /// Append `tensor` with `vals` (its `vals` field is set here: the last entry of
    /// [`Arena::tensor_vals`] when equal, else a new one); returns its index.
    pub fn push_tensor(
        &mut self,
        mut tensor: Tensor,
        vals: TensorVals,
    ) -> Result<u32, Unsupported> {
        let index = u32::try_from(self.tensors.len()).map_err(|_| Unsupported)?;
        if self.tensor_vals.last() != Some(&vals) {
            u32::try_from(self.tensor_vals.len()).map_err(|_| Unsupported)?;
            self.tensor_vals.push(vals);
        }
        tensor.vals = (self.tensor_vals.len() - 1) as u32;
        self.tensors.push(tensor);
        Ok(index)
    }

    /// `tensor`'s [`TensorVals`].
    pub fn vals_of(&self, tensor: &Tensor) -> TensorVals {
        self.tensor_vals[tensor.vals as usize]
    }

    fn node(&self, index: u32) -> &Node {
        &self.nodes[index as usize]
    }

    /// Python's `bool(value)` for the values the walk and `_hooks` test.
    fn truthy(&self, value: Val) -> bool {
        match value {
            Val::None | Val::EmptyHooks => false,
            Val::Bool(b) => b,
            Val::Int(i) => i != 0,
            Val::Float(f) => f != 0.0,
            Val::Str(s) => self.strs[s as usize].1 != 0,
            Val::Global(_) | Val::Absent => true,
            Val::Node(n) => match self.node(n) {
                Node::Dict(span)
                | Node::OrderedDict(span, _)
                | Node::List(span)
                | Node::Tuple(span) => span.len != 0,
                _ => true,
            },
        }
    }
}

/// `pickling/names.py`'s `is_dotted_identifier`: ASCII identifiers joined by single dots.
pub fn is_dotted_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.bytes();
            matches!(chars.next(), Some(c) if c == b'_' || c.is_ascii_alphabetic())
                && chars.all(|c| c == b'_' || c.is_ascii_alphanumeric())
        })
}

// -- the walk -------------------------------------------------------------------------------

/// What a walk frame iterates: a span of a node's values (every `step`-th, then `extra`), or
/// a list of children popped from its end.
enum Frame {
    Vals {
        next: usize,
        end: usize,
        step: usize,
        extra: Option<Val>,
    },
    Owned(Vec<Child>),
}

/// A child in an owned frame: a value, or a tensor's `__param__` tuple -- a fresh tuple in the
/// walk (`walk._tensor_children`), so never seen before and entered one level down.
#[derive(Clone, Copy)]
enum Child {
    Value(Val),
    Param(Param),
}

/// The nodes `model/walk.py`'s `walk(root, revisit=...)` reaches more than once: the ones the
/// Python emitter memoizes. Deeper nesting than the walk allows is [`Unsupported`] (the Python
/// side raises its error).
pub fn shared_nodes(arena: &Arena, root: Val) -> Result<Vec<bool>, Unsupported> {
    let mut shared = vec![false; arena.nodes.len()];
    let mut seen = vec![false; arena.nodes.len()];
    let Val::Node(root_node) = root else {
        return Ok(shared);
    };
    if matches!(arena.node(root_node), Node::Storage { .. }) {
        return Ok(shared);
    }
    seen[root_node as usize] = true;
    let mut stack: Vec<(Frame, usize)> = vec![(children(arena, root_node), 0)];
    while let Some((frame, depth)) = stack.last_mut() {
        let depth = *depth;
        let child = match frame {
            Frame::Vals {
                next,
                end,
                step,
                extra,
            } => {
                if *next < *end {
                    let value = arena.vals[*next];
                    *next += *step;
                    Some(Child::Value(value))
                } else {
                    extra.take().map(Child::Value)
                }
            }
            Frame::Owned(items) => items.pop(),
        };
        let Some(child) = child else {
            stack.pop();
            continue;
        };
        let child_depth = depth + 1;
        let n = match child {
            Child::Param(param) => {
                if child_depth > MAX_NESTING {
                    return Err(Unsupported);
                }
                let items = [param.state, param.hooks, param.requires_grad]
                    .map(Child::Value)
                    .to_vec();
                stack.push((Frame::Owned(items), child_depth));
                continue;
            }
            Child::Value(Val::Node(n)) => n,
            Child::Value(_) => continue, // atoms, globals, markers: nothing inside
        };
        let index = n as usize;
        match arena.node(n) {
            Node::Storage { .. } => {}
            Node::Tensor(t) => {
                let tensor = &arena.tensors[*t as usize];
                let vals = arena.vals_of(tensor);
                let inner = arena.truthy(vals.hooks)
                    || vals.metadata != Val::Absent
                    || tensor.param.is_some();
                let first = !seen[index];
                if first {
                    seen[index] = true;
                } else {
                    shared[index] = true;
                }
                if inner && first {
                    stack.push((tensor_children(arena, tensor), child_depth));
                }
            }
            Node::Pending => return Err(Unsupported),
            _ => {
                if seen[index] {
                    shared[index] = true;
                    continue;
                }
                seen[index] = true;
                if child_depth > MAX_NESTING {
                    return Err(Unsupported);
                }
                stack.push((children(arena, n), child_depth));
            }
        }
    }
    Ok(shared)
}

/// A node's children in the walk's order (`model/walk.py` CHILDREN): dict values (not keys),
/// an OrderedDict's values then its `__dict__`, sequence items, a Reduce's args then state.
fn children(arena: &Arena, node: u32) -> Frame {
    let span_of = |span: Span, step: usize, skip: usize, extra: Option<Val>| Frame::Vals {
        next: span.start as usize + skip,
        end: span.start as usize + span.len as usize,
        step,
        extra,
    };
    match arena.node(node) {
        Node::Dict(span) => span_of(*span, 2, 1, None),
        Node::OrderedDict(span, attrs) => span_of(*span, 2, 1, *attrs),
        Node::List(span) | Node::Tuple(span) => span_of(*span, 1, 0, None),
        Node::Reduce { args, state, .. } => {
            let extra = if *state == Val::Absent {
                None
            } else {
                Some(*state)
            };
            match arena.node(*args) {
                Node::Tuple(span) => span_of(*span, 1, 0, extra),
                _ => Frame::Owned(extra.into_iter().map(Child::Value).collect()),
            }
        }
        Node::Tensor(t) => tensor_children(arena, &arena.tensors[*t as usize]),
        Node::Storage { .. } | Node::Pending => Frame::Owned(Vec::new()),
    }
}

/// `walk._tensor_children`: hooks if truthy, metadata if present, the parameter's tuple.
fn tensor_children(arena: &Arena, tensor: &Tensor) -> Frame {
    let mut items = Vec::new();
    if let Some(param) = tensor.param.as_deref() {
        items.push(Child::Param(*param)); // popped from the end: last in walk order goes first
    }
    let vals = arena.vals_of(tensor);
    if vals.metadata != Val::Absent {
        items.push(Child::Value(vals.metadata));
    }
    if arena.truthy(vals.hooks) {
        items.push(Child::Value(vals.hooks));
    }
    Frame::Owned(items)
}

// -- the emitter ----------------------------------------------------------------------------

const MARK: &[u8] = b"(";
const TUPLE: &[u8] = b"t";
const EMPTY_TUPLE: &[u8] = b")";
const TUPLE_N: [&[u8]; 4] = [b")", b"\x85", b"\x86", b"\x87"];
const EMPTY_DICT: &[u8] = b"}";
const SETITEMS: &[u8] = b"u";
const EMPTY_LIST: &[u8] = b"]";
const APPENDS: &[u8] = b"e";
const REDUCE: &[u8] = b"R";
const BUILD: &[u8] = b"b";
const TUPLE_REDUCE: &[u8] = b"tR";
const BINPERSID: &[u8] = b"Q";
const POP: &[u8] = b"0";
const POP_MARK: &[u8] = b"1";
const NO_MEMO: u32 = u32::MAX;

/// One entry of the work stack (writer.py's todo: a value, `_Raw` bytes, or a `_Then` step).
#[derive(Debug, Clone, Copy)]
enum Task {
    Value(Val),
    Raw(&'static [u8]),
    CloseTuple(u32),
    /// `put(id(node))`: memoize it if shared
    Put(u32),
    /// `dict(state)` of an OrderedDict's `__dict__` (a fresh dict: memoized, never fetched)
    DictCopy(u32),
}

/// What [`dumps`] returns: the pickle, and the storage nodes in key order ("0", "1", ...).
#[derive(Debug)]
pub struct Pickled {
    pub data: Vec<u8>,
    pub storages: Vec<u32>,
}

struct Emitter<'a> {
    arena: &'a Arena,
    shared: Vec<bool>,
    out: Vec<u8>,
    node_memo: Vec<u32>,
    str_memo: FastMap<&'a [u8], u32>,
    global_memo: Vec<u32>,
    next_memo: u32,
    storage_keys: Vec<u32>,
    storages: Vec<u32>,
    todo: Vec<Task>,
}

/// Pickle `root` the way `writer.dumps` does; [`Unsupported`] where its bytes would not be
/// the Python emitter's (see the module doc).
pub fn dumps(arena: &Arena, root: Val) -> Result<Pickled, Unsupported> {
    let shared = shared_nodes(arena, root)?;
    let mut emitter = Emitter {
        arena,
        shared,
        out: Vec::with_capacity(
            64 + arena.text.len() + 60 * arena.tensors.len() + 4 * arena.vals.len(),
        ),
        node_memo: vec![NO_MEMO; arena.nodes.len()],
        str_memo: FastMap::default(),
        global_memo: vec![NO_MEMO; arena.globals.len()],
        next_memo: 0,
        storage_keys: vec![NO_MEMO; arena.nodes.len()],
        storages: Vec::new(),
        todo: Vec::new(),
    };
    emitter.out.extend_from_slice(b"\x80\x02");
    emitter.run(root)?;
    emitter.out.push(b'.');
    Ok(Pickled {
        data: emitter.out,
        storages: emitter.storages,
    })
}

impl<'a> Emitter<'a> {
    // -- memo ---------------------------------------------------------------------------
    fn write_get(&mut self, index: u32) {
        if index < 256 {
            self.out.extend_from_slice(&[b'h', index as u8]);
        } else {
            self.out.push(b'j');
            self.out.extend_from_slice(&index.to_le_bytes());
        }
    }

    fn write_put(&mut self, index: u32) {
        if index < 256 {
            self.out.extend_from_slice(&[b'q', index as u8]);
        } else {
            self.out.push(b'r');
            self.out.extend_from_slice(&index.to_le_bytes());
        }
    }

    fn new_index(&mut self) -> Result<u32, Unsupported> {
        let index = self.next_memo;
        self.next_memo = index
            .checked_add(1)
            .filter(|n| *n < NO_MEMO)
            .ok_or(Unsupported)?;
        Ok(index)
    }

    /// `get(id(node))`: a memo fetch if the node was memoized.
    fn get(&mut self, node: u32) -> bool {
        let index = self.node_memo[node as usize];
        if index == NO_MEMO {
            return false;
        }
        self.write_get(index);
        true
    }

    /// `put(id(node), always)`. A node memoized twice (a tensor reached through its own
    /// metadata) gets a second slot in Python with a repeated index: left to Python.
    fn put(&mut self, node: u32, always: bool) -> Result<(), Unsupported> {
        if !always && !self.shared[node as usize] {
            return Ok(());
        }
        if self.node_memo[node as usize] != NO_MEMO {
            return Err(Unsupported);
        }
        let index = self.new_index()?;
        self.node_memo[node as usize] = index;
        self.write_put(index);
        Ok(())
    }

    /// A memo slot for an object made while writing (nothing can fetch it).
    fn put_fresh(&mut self) -> Result<(), Unsupported> {
        let index = self.new_index()?;
        self.write_put(index);
        Ok(())
    }

    // -- atoms --------------------------------------------------------------------------
    fn int(&mut self, value: i64) {
        let out = &mut self.out;
        if (0..256).contains(&value) {
            out.extend_from_slice(&[b'K', value as u8]);
        } else if (0..65536).contains(&value) {
            out.push(b'M');
            out.extend_from_slice(&(value as u16).to_le_bytes());
        } else if let Ok(small) = i32::try_from(value) {
            out.push(b'J');
            out.extend_from_slice(&small.to_le_bytes());
        } else {
            // value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            let bits = 64 - value.unsigned_abs().leading_zeros() as usize;
            let n = (bits + 8) / 8;
            out.extend_from_slice(&[0x8a, n as u8]);
            out.extend_from_slice(&(value as i128).to_le_bytes()[..n]);
        }
    }

    fn string(&mut self, index: u32) -> Result<(), Unsupported> {
        let bytes = self.arena.str_bytes(index);
        if let Some(&memo) = self.str_memo.get(bytes) {
            self.write_get(memo);
            return Ok(());
        }
        let len = u32::try_from(bytes.len()).map_err(|_| Unsupported)?;
        self.out.push(b'X');
        self.out.extend_from_slice(&len.to_le_bytes());
        self.out.extend_from_slice(bytes);
        if bytes.len() <= MEMO_STR {
            let memo = self.new_index()?;
            self.str_memo.insert(bytes, memo);
            self.write_put(memo);
        }
        Ok(())
    }

    /// `_Emitter.atom`: write `value` if it is an atom; false if it needs the work stack.
    fn atom(&mut self, value: Val) -> Result<bool, Unsupported> {
        match value {
            Val::Str(s) => self.string(s)?,
            Val::Int(i) => self.int(i),
            Val::Bool(b) => self.out.push(if b { 0x88 } else { 0x89 }),
            Val::None => self.out.push(b'N'),
            Val::Float(f) => {
                self.out.push(b'G');
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Val::Global(g) => self.global(g)?,
            Val::EmptyHooks | Val::Absent | Val::Node(_) => return Ok(false),
        }
        Ok(true)
    }

    fn global(&mut self, global: u32) -> Result<(), Unsupported> {
        let memo = self.global_memo[global as usize];
        if memo != NO_MEMO {
            self.write_get(memo);
            return Ok(());
        }
        let GlobalName { module, name } = &self.arena.globals[global as usize];
        let module = if module == "builtins" {
            "__builtin__"
        } else {
            module
        };
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        let index = self.new_index()?;
        self.global_memo[global as usize] = index;
        self.write_put(index);
        Ok(())
    }

    /// A shape or stride: small tuple of ints, no memo.
    fn int_tuple(&mut self, span: Span) {
        let values = &self.arena.ints[span.range()];
        let n = values.len();
        if n > 3 {
            self.out.extend_from_slice(MARK);
        }
        for &v in values {
            self.int(v);
        }
        self.out
            .extend_from_slice(if n <= 3 { TUPLE_N[n] } else { TUPLE });
    }

    // -- the loop -------------------------------------------------------------------------
    fn run(&mut self, root: Val) -> Result<(), Unsupported> {
        // a bound on the steps: the Python emitter never ends on a cycle of tuples and records
        // alone (nothing memoized before its contents); such a tree is left to it
        let mut budget = 64usize
            .saturating_mul(self.arena.vals.len() + self.arena.nodes.len() + self.arena.ints.len())
            .saturating_add(1 << 20);
        self.todo.push(Task::Value(root));
        while let Some(task) = self.todo.pop() {
            budget = budget.checked_sub(1).ok_or(Unsupported)?;
            match task {
                Task::Raw(bytes) => self.out.extend_from_slice(bytes),
                Task::CloseTuple(node) => self.close_tuple(node)?,
                Task::Put(node) => self.put(node, false)?,
                Task::DictCopy(node) => self.dict_copy(node)?,
                Task::Value(value) => {
                    if !self.atom(value)? {
                        self.write(value)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn write(&mut self, value: Val) -> Result<(), Unsupported> {
        let node = match value {
            Val::EmptyHooks => return self.empty_hooks(),
            Val::Node(node) => node,
            _ => return Err(Unsupported), // ABSENT where a value goes: Python refuses it
        };
        match self.arena.node(node) {
            Node::Dict(span) => self.dict(node, *span),
            Node::OrderedDict(span, attrs) => self.ordered_dict(node, *span, *attrs),
            Node::List(span) => self.list(node, *span),
            Node::Tuple(span) => self.tuple(node, *span),
            Node::Tensor(t) => self.tensor(node, *t),
            Node::Storage { .. } => self.storage(node),
            Node::Reduce { func, args, state } => self.reduce(node, *func, *args, *state),
            Node::Pending => Err(Unsupported),
        }
    }

    /// Queue `items` to be written in order, before anything queued earlier.
    fn later(&mut self, items: Vec<Task>) {
        self.todo.extend(items.into_iter().rev());
    }

    /// MARK, up to 1000 items (or pairs), APPENDS/SETITEMS.
    fn batches(&self, span: Span, closing: &'static [u8], pairs: bool, pending: &mut Vec<Task>) {
        let items = &self.arena.vals[span.range()];
        let per = if pairs { 2 * BATCH } else { BATCH };
        for chunk in items.chunks(per) {
            pending.push(Task::Raw(MARK));
            pending.extend(chunk.iter().map(|v| Task::Value(*v)));
            pending.push(Task::Raw(closing));
        }
    }

    // -- containers -----------------------------------------------------------------------
    fn tuple(&mut self, node: u32, span: Span) -> Result<(), Unsupported> {
        if self.get(node) {
            return Ok(());
        }
        let n = span.len as usize;
        if n == 0 {
            self.out.extend_from_slice(EMPTY_TUPLE);
            return Ok(());
        }
        if n > 3 {
            self.out.extend_from_slice(MARK);
        }
        self.todo.push(Task::CloseTuple(node));
        let items = self.arena.vals[span.range()]
            .iter()
            .map(|v| Task::Value(*v))
            .collect();
        self.later(items);
        Ok(())
    }

    fn close_tuple(&mut self, node: u32) -> Result<(), Unsupported> {
        let Node::Tuple(span) = self.arena.node(node) else {
            return Err(Unsupported);
        };
        let n = span.len as usize;
        if self.node_memo[node as usize] != NO_MEMO {
            // the tuple reached itself through a list: pickle's recursion rule
            if n <= 3 {
                for _ in 0..n {
                    self.out.extend_from_slice(POP);
                }
            } else {
                self.out.extend_from_slice(POP_MARK);
            }
            self.get(node);
            return Ok(());
        }
        self.out
            .extend_from_slice(if n <= 3 { TUPLE_N[n] } else { TUPLE });
        self.put(node, false)
    }

    fn list(&mut self, node: u32, span: Span) -> Result<(), Unsupported> {
        if self.get(node) {
            return Ok(());
        }
        self.out.extend_from_slice(EMPTY_LIST);
        self.put(node, true)?;
        let mut pending = Vec::new();
        self.batches(span, APPENDS, false, &mut pending);
        self.later(pending);
        Ok(())
    }

    fn dict(&mut self, node: u32, span: Span) -> Result<(), Unsupported> {
        if self.get(node) {
            return Ok(());
        }
        self.out.extend_from_slice(EMPTY_DICT);
        self.put(node, true)?;
        let mut pending = Vec::new();
        self.batches(span, SETITEMS, true, &mut pending);
        self.later(pending);
        Ok(())
    }

    fn dict_copy(&mut self, node: u32) -> Result<(), Unsupported> {
        let Node::Dict(span) = self.arena.node(node) else {
            return Err(Unsupported);
        };
        let span = *span;
        self.out.extend_from_slice(EMPTY_DICT);
        self.put_fresh()?;
        let mut pending = Vec::new();
        self.batches(span, SETITEMS, true, &mut pending);
        self.later(pending);
        Ok(())
    }

    /// `OrderedDict()` then items then BUILD with a copy of `__dict__` (`_metadata`).
    fn ordered_dict(
        &mut self,
        node: u32,
        span: Span,
        attrs: Option<Val>,
    ) -> Result<(), Unsupported> {
        if self.get(node) {
            return Ok(());
        }
        self.global(ORDERED_DICT)?;
        self.out.extend_from_slice(b")R");
        self.put(node, true)?;
        if let Some(attrs) = attrs {
            let Val::Node(dict) = attrs else {
                return Err(Unsupported);
            };
            self.later(vec![Task::DictCopy(dict), Task::Raw(BUILD)]);
        }
        if span.len != 0 {
            let mut pending = Vec::new();
            self.batches(span, SETITEMS, true, &mut pending);
            self.later(pending);
        }
        Ok(())
    }

    fn reduce(&mut self, node: u32, func: u32, args: u32, state: Val) -> Result<(), Unsupported> {
        if self.get(node) {
            return Ok(());
        }
        self.global(func)?;
        let mut pending = vec![
            Task::Value(Val::Node(args)),
            Task::Raw(REDUCE),
            Task::Put(node),
        ];
        if state != Val::Absent {
            pending.extend([Task::Value(state), Task::Raw(BUILD)]);
        }
        self.later(pending);
        Ok(())
    }

    fn empty_hooks(&mut self) -> Result<(), Unsupported> {
        self.global(ORDERED_DICT)?;
        self.out.extend_from_slice(b")R");
        Ok(())
    }

    // -- tensors ----------------------------------------------------------------------------
    fn storage(&mut self, node: u32) -> Result<(), Unsupported> {
        let Node::Storage {
            storage_type,
            location,
            numel,
        } = *self.arena.node(node)
        else {
            return Err(Unsupported);
        };
        let mut key = self.storage_keys[node as usize];
        if key == NO_MEMO {
            key = u32::try_from(self.storages.len()).map_err(|_| Unsupported)?;
            self.storage_keys[node as usize] = key;
            self.storages.push(node);
        }
        self.out.extend_from_slice(MARK);
        self.string(STORAGE_WORD)?;
        self.global(storage_type)?;
        let mut digits = [0u8; 10];
        let mut start = digits.len();
        let mut rest = key;
        loop {
            start -= 1;
            digits[start] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        self.out.push(b'X');
        self.out
            .extend_from_slice(&((digits.len() - start) as u32).to_le_bytes());
        self.out.extend_from_slice(&digits[start..]);
        self.string(location)?;
        self.int(numel);
        self.out.extend_from_slice(TUPLE);
        self.out.extend_from_slice(BINPERSID);
        Ok(())
    }

    /// One tensor record, as torch.save writes it (writer.py `tensor`, same steps).
    fn tensor(&mut self, node: u32, t: u32) -> Result<(), Unsupported> {
        if self.get(node) {
            return Ok(());
        }
        let tensor = &self.arena.tensors[t as usize];
        if let Some(param) = tensor.param.as_deref() {
            let which = if param.state != Val::Absent {
                REBUILD_PARAM_STATE
            } else {
                REBUILD_PARAM
            };
            self.global(which)?;
            self.out.extend_from_slice(MARK);
        }
        let rebuild = if tensor.v3 { REBUILD_V3 } else { REBUILD_V2 };
        self.global(rebuild)?;
        self.out.extend_from_slice(MARK);
        self.storage(tensor.storage)?;
        self.int(tensor.offset);
        self.int_tuple(tensor.shape);
        self.int_tuple(tensor.stride);
        let mut pending: Vec<Task> = Vec::new();
        let vals = self.arena.vals_of(tensor);
        if !self.atom(vals.requires_grad)? {
            pending.push(Task::Value(vals.requires_grad));
        }
        self.hooks(vals.hooks, &mut pending)?;
        if tensor.v3 {
            pending.push(Task::Value(vals.dtype_global));
        }
        if vals.metadata != Val::Absent {
            pending.push(Task::Value(vals.metadata));
        }
        if tensor.param.is_none() && pending.is_empty() {
            self.out.extend_from_slice(TUPLE_REDUCE);
            return self.put(node, false);
        }
        pending.push(Task::Raw(TUPLE_REDUCE));
        if let Some(param) = tensor.param.as_deref() {
            pending.push(Task::Value(param.requires_grad));
            pending.push(Task::Value(param.hooks));
            if param.state != Val::Absent {
                pending.push(Task::Value(param.state));
            }
            pending.push(Task::Raw(TUPLE_REDUCE));
        }
        pending.push(Task::Put(node));
        self.later(pending);
        Ok(())
    }

    /// writer.py `_hooks`: `OrderedDict()` inline for the empty hooks of the common case.
    fn hooks(&mut self, hooks: Val, pending: &mut Vec<Task>) -> Result<(), Unsupported> {
        if hooks == Val::EmptyHooks && pending.is_empty() {
            return self.empty_hooks();
        }
        let plain_empty = match hooks {
            Val::Node(n) => {
                matches!(self.arena.node(n), Node::OrderedDict(span, None) if span.len == 0)
            }
            _ => false,
        };
        if !pending.is_empty() || !plain_empty {
            pending.push(Task::Value(hooks));
            return Ok(());
        }
        let Val::Node(node) = hooks else {
            return Err(Unsupported);
        };
        if self.get(node) {
            return Ok(());
        }
        self.empty_hooks()?;
        self.put(node, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny builder for hand-made trees (emit_py builds them from Python in real use).
    struct Tree {
        arena: Arena,
    }

    impl Tree {
        fn new() -> Self {
            Tree {
                arena: Arena::new(),
            }
        }
        fn s(&mut self, text: &str) -> Val {
            self.arena.add_str(text.as_bytes()).unwrap()
        }
        fn dict(&mut self, items: &[Val]) -> Val {
            let span = self.arena.add_vals(items).unwrap();
            Val::Node(self.arena.add_node(Node::Dict(span)).unwrap())
        }
        fn list(&mut self, items: &[Val]) -> Val {
            let span = self.arena.add_vals(items).unwrap();
            Val::Node(self.arena.add_node(Node::List(span)).unwrap())
        }
        fn tuple(&mut self, items: &[Val]) -> Val {
            let span = self.arena.add_vals(items).unwrap();
            Val::Node(self.arena.add_node(Node::Tuple(span)).unwrap())
        }
        fn storage(&mut self, numel: i64) -> u32 {
            let Val::Global(g) = self.arena.add_global("torch", "FloatStorage").unwrap() else {
                panic!()
            };
            let Val::Str(loc) = self.s("cpu") else {
                panic!()
            };
            self.arena
                .add_node(Node::Storage {
                    storage_type: g,
                    location: loc,
                    numel,
                })
                .unwrap()
        }
        fn tensor(&mut self, storage: u32, shape: &[i64]) -> Val {
            let shape = self.arena.add_ints(shape).unwrap();
            let stride = self.arena.add_ints(&[1]).unwrap();
            let tensor = Tensor {
                storage,
                vals: 0,
                offset: 0,
                shape,
                stride,
                v3: false,
                param: None,
            };
            let vals = TensorVals {
                requires_grad: Val::Bool(false),
                hooks: Val::EmptyHooks,
                dtype_global: Val::None,
                metadata: Val::Absent,
            };
            Val::Node(self.arena.add_tensor(tensor, vals).unwrap())
        }
    }

    #[test]
    fn dotted_identifiers_as_python_says() {
        for good in ["os.path", "_codecs", "Outer.Inner", "a1.b_2"] {
            assert!(is_dotted_identifier(good), "{good}");
        }
        for bad in ["", "a..b", ".a", "a.", "a b", "a\nb", "é", "1a"] {
            assert!(!is_dotted_identifier(bad), "{bad}");
        }
    }

    #[test]
    fn ints_as_python_encodes_them() {
        let cases: &[(i64, &[u8])] = &[
            (0, b"K\x00"),
            (255, b"K\xff"),
            (256, b"M\x00\x01"),
            (65536, b"J\x00\x00\x01\x00"),
            (-1, b"J\xff\xff\xff\xff"),
            (1 << 31, b"\x8a\x05\x00\x00\x00\x80\x00"),
            (-(1 << 31) - 1, b"\x8a\x05\xff\xff\xff\x7f\xff"),
            (i64::MIN, b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\xff"),
        ];
        for (value, bytes) in cases {
            let mut tree = Tree::new();
            let root = tree.list(&[Val::Int(*value)]);
            let data = dumps(&tree.arena, root).unwrap().data;
            let mut want = b"\x80\x02]q\x00(".to_vec();
            want.extend_from_slice(bytes);
            want.extend_from_slice(b"e.");
            assert_eq!(data, want, "{value}");
        }
    }

    #[test]
    fn a_tied_tensor_is_written_once_and_fetched() {
        let mut tree = Tree::new();
        let storage = tree.storage(4);
        let t = tree.tensor(storage, &[4]);
        let (a, b) = (tree.s("a"), tree.s("b"));
        let root = tree.dict(&[a, t, b, t]);
        let pickled = dumps(&tree.arena, root).unwrap();
        assert_eq!(pickled.storages, vec![storage]);
        let data = pickled.data;
        assert_eq!(data.windows(2).filter(|w| w == b"tR").count(), 1); // one reduce for the tensor
        assert!(data.ends_with(b"h\x07u."), "{data:?}"); // b's value is a memo fetch
    }

    #[test]
    fn nesting_past_the_walk_limit_is_left_to_python() {
        let mut tree = Tree::new();
        let mut value = Val::Int(1);
        for _ in 0..MAX_NESTING {
            value = tree.list(&[value]);
        }
        assert!(dumps(&tree.arena, value).is_ok()); // the root is depth 0: 999 levels below it
        let deeper = tree.list(&[value]);
        let deepest = tree.list(&[deeper]);
        assert_eq!(dumps(&tree.arena, deepest).unwrap_err(), Unsupported);
    }

    #[test]
    fn a_cycle_of_tuples_alone_is_left_to_python() {
        let mut tree = Tree::new();
        let inner = tree.tuple(&[Val::Int(1)]);
        let Val::Node(n) = inner else { panic!() };
        let span = tree.arena.add_vals(&[inner]).unwrap();
        tree.arena.nodes[n as usize] = Node::Tuple(span); // the tuple holds itself
        assert_eq!(dumps(&tree.arena, inner).unwrap_err(), Unsupported);
    }

    #[test]
    fn a_tuple_through_a_list_closes_as_pickle_does() {
        let mut tree = Tree::new();
        let list = tree.list(&[]);
        let tuple = tree.tuple(&[list]);
        let (Val::Node(l), Val::Node(_)) = (list, tuple) else {
            panic!()
        };
        let span = tree.arena.add_vals(&[tuple]).unwrap();
        tree.arena.nodes[l as usize] = Node::List(span);
        let data = dumps(&tree.arena, tuple).unwrap().data;
        // ( ] q0 ( ( h0 ... : the inner tuple is written, then popped and fetched
        assert_eq!(data, b"\x80\x02]q\x00(h\x00\x85q\x01e0h\x01.".to_vec());
    }
}
