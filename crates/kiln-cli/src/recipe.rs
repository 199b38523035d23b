//! Recipes: YAML files with a top-level `task:`, `extends:` includes and dotted `--set` overrides.
//!
//! Loading goes:
//!
//! 1. read + parse every file once (a file over [`MAX_FILE_BYTES`] is refused before it is parsed;
//!    syntax errors carry file:line:column). One pass over each file's text builds a [`KeyIndex`]
//!    (key path -> line:column), so locating any key for an error message is a lookup, linear in
//!    the file size overall. Unknown YAML tags (`!evil 5`) are refused at their file:line.
//! 2. resolve `extends` (allowed at any mapping level; the included file is merged at that level,
//!    the including mapping wins; cycles are refused). At most [`MAX_INCLUDES`] includes and
//!    [`MAX_KEYS`] keys are loaded in all, so an exponential fan-out (each file extending two
//!    copies of the next) stops at once with the `extends` line that went over.
//! 3. apply `--set a.b=value` (value parsed as YAML, same tag rule).
//!
//!    Steps 1-3 keep every key path at most [`MAX_DEPTH`] levels deep, so nothing later (merging,
//!    conversion, schema check, dropping the tree) can recurse deep enough to overflow the stack.
//! 4. check every key against the JSON schema of the task's config structs (unknown keys are
//!    rejected with their full path and a "did you mean").
//! 5. check model and batch sizes against sane ceilings and the machine's memory
//!    ([`crate::resources`]; the refusal gives the estimate and the machine's memory).
//! 6. deserialize into the typed structs (type errors carry the file:line:column where the value
//!    was written) -> semantic validation.
//!
//! Provenance of every key (file or `--set`) is tracked through the merge so errors point at the
//! place a user has to edit. Every error says what is wrong, where, and how to fix it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_norway::{Mapping, Value};

/// Deepest key path a recipe may hold (`a.b.c` is 3 deep; real recipes nest about 5 deep).
pub const MAX_DEPTH: usize = 32;
/// Largest recipe or `extends` file.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Most `extends` includes loaded for one recipe (the same file included twice counts twice).
pub const MAX_INCLUDES: usize = 256;
/// Most mapping keys loaded for one recipe, over all its files and includes.
pub const MAX_KEYS: usize = 100_000;

/// Where a recipe value came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// A YAML file, with the 1-based line and column when known.
    File {
        /// The file.
        path: PathBuf,
        /// 1-based line and column.
        pos: Option<(usize, usize)>,
    },
    /// A `--set` override.
    Set(String),
    /// Not written anywhere (a default or a missing key).
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File {
                path,
                pos: Some((l, c)),
            } => write!(f, "{}:{l}:{c}", path.display()),
            Origin::File { path, pos: None } => write!(f, "{}", path.display()),
            Origin::Set(s) => write!(f, "--set {}", short(s)),
            Origin::Default => write!(f, "(default)"),
        }
    }
}

/// `s` cut to a length that fits an error message (a `--set` argument may be 100 kB long).
fn short(s: &str) -> String {
    const KEEP: usize = 80;
    if s.chars().count() <= KEEP {
        s.to_string()
    } else {
        let head: String = s.chars().take(KEEP).collect();
        format!("{head}... ({} bytes)", s.len())
    }
}

/// A recipe that could not be loaded. Every variant says what, where and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// A recipe or `extends` file does not exist.
    #[error(
        "recipe file not found: {path}\n  tried: {tried}\n  hint: paths in `extends:` are relative to the including file, the current directory or configs/"
    )]
    NotFound {
        /// The path as written.
        path: String,
        /// Every candidate that was tried.
        tried: String,
    },
    /// A file could not be read.
    #[error("{path}: cannot read: {msg}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        msg: String,
    },
    /// YAML syntax error.
    #[error("{at}: YAML syntax error: {msg}")]
    Syntax {
        /// Location.
        at: Origin,
        /// Parser message.
        msg: String,
    },
    /// A YAML tag (`!name value`) other than YAML's own; recipes are plain data.
    #[error(
        "{at}: unsupported YAML tag `{tag}` on `{path}`\n  hint: recipes are plain YAML data: remove the tag (write the value alone, quoted if it must stay a string)"
    )]
    Tag {
        /// Where.
        at: Origin,
        /// The tag as written.
        tag: String,
        /// Dotted path of the tagged value.
        path: String,
    },
    /// A recipe over one of the loader's limits (depth, file size, includes, keys).
    #[error("{at}: {what}\n  hint: {fix}")]
    Limit {
        /// Where.
        at: Origin,
        /// Which limit and by how much.
        what: String,
        /// How to stay within it.
        fix: String,
    },
    /// `extends` includes itself.
    #[error("{at}: `extends` cycle: {chain}")]
    Cycle {
        /// Where.
        at: Origin,
        /// The chain of files.
        chain: String,
    },
    /// A key that no config struct has.
    #[error("{at}: unknown key `{path}`{suggestion}\n  valid keys here: {valid}")]
    UnknownKey {
        /// Where.
        at: Origin,
        /// Full dotted path.
        path: String,
        /// ` (did you mean `x`?)` or empty.
        suggestion: String,
        /// The keys allowed at that level.
        valid: String,
    },
    /// A value of the wrong type or an unknown enum variant.
    #[error("{at}: invalid value for `{path}`: {msg}")]
    Type {
        /// Where.
        at: Origin,
        /// Full dotted path.
        path: String,
        /// What serde expected.
        msg: String,
    },
    /// A well-typed value outside its allowed range.
    #[error("{at}: invalid `{path}`: {msg}")]
    Invalid {
        /// Where.
        at: Origin,
        /// Full dotted path.
        path: String,
        /// What is wrong and how to fix it.
        msg: String,
    },
    /// A malformed `--set`.
    #[error("--set {}: {msg}", short(.arg))]
    BadSet {
        /// The argument.
        arg: String,
        /// What is wrong.
        msg: String,
    },
    /// `task:` missing or unknown.
    #[error("{at}: {msg}")]
    Task {
        /// Where.
        at: Origin,
        /// What is wrong.
        msg: String,
    },
}

/// A merged recipe tree with the origin of every key.
#[derive(Debug, Clone)]
pub struct RawRecipe {
    /// The merged YAML tree.
    pub value: Value,
    /// Origin of every dotted key path.
    pub origins: BTreeMap<String, Origin>,
    /// The top-level recipe file.
    pub file: Option<PathBuf>,
}

/// `prefix.key`, or `key` at the root.
pub(crate) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn key_str(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        other => serde_norway::to_string(other)
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    }
}

/// Key path -> position of every block-style key of one YAML text, built in one pass.
///
/// A trie over key segments: node 0 is the root, every `key:` line adds (or revisits) the child of
/// the innermost open key with a smaller indent. A lookup walks `path.len()` nodes, so locating
/// all keys of a file costs time linear in its size (searching the text once per key was
/// quadratic: 20,000 keys took 26 s).
#[derive(Debug, Default)]
pub struct KeyIndex {
    /// Per node: its children by key.
    children: Vec<HashMap<String, usize>>,
    /// Per node: 1-based (line, column of the value) of the last line that wrote the key.
    pos: Vec<Option<(usize, usize)>>,
}

impl KeyIndex {
    /// Index the block-style keys of `text` (flow mappings `{a: 1}` are not indexed; their values
    /// are located at the enclosing key).
    pub fn build(text: &str) -> Self {
        let mut ix = KeyIndex {
            children: vec![HashMap::new()],
            pos: vec![None],
        };
        // (indent, node) of the open keys, outermost first
        let mut stack: Vec<(usize, usize)> = Vec::new();
        for (ln, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let mut indent = line.len() - trimmed.len();
            let mut rest = trimmed;
            if let Some(r) = rest.strip_prefix("- ") {
                indent += 2;
                rest = r;
            }
            let Some(colon) = rest.find(':') else {
                continue;
            };
            let key = rest[..colon].trim().trim_matches(|c| c == '"' || c == '\'');
            if key.is_empty() || key.contains(' ') && !key.starts_with('"') && key.contains('{') {
                continue;
            }
            while stack.last().is_some_and(|(i, _)| *i >= indent) {
                stack.pop();
            }
            let parent = stack.last().map_or(0, |(_, n)| *n);
            let node = match ix.children[parent].get(key) {
                Some(n) => *n,
                None => {
                    let n = ix.pos.len();
                    ix.children.push(HashMap::new());
                    ix.pos.push(None);
                    ix.children[parent].insert(key.to_string(), n);
                    n
                }
            };
            stack.push((indent, node));
            let after = &rest[colon + 1..];
            let vcol = after.len() - after.trim_start().len();
            let col = if after.trim().is_empty() {
                indent + 1
            } else {
                indent + colon + 1 + vcol + 1
            };
            ix.pos[node] = Some((ln + 1, col));
        }
        ix
    }

    /// 1-based (line, column of the value) of the key `path` (segments below the root).
    pub fn get<S: AsRef<str>>(&self, path: &[S]) -> Option<(usize, usize)> {
        if path.is_empty() {
            return None;
        }
        let mut node = 0;
        for seg in path {
            node = *self.children[node].get(seg.as_ref())?;
        }
        self.pos[node]
    }

    /// Position of `path` or, failing that, of its nearest indexed ancestor (a value inside a
    /// list or a flow mapping is located at the key that holds it).
    pub fn nearest<S: AsRef<str>>(&self, path: &[S]) -> Option<(usize, usize)> {
        (1..=path.len()).rev().find_map(|n| self.get(&path[..n]))
    }
}

/// Depth of the deepest value of `v` (a scalar is 0, `{a: 1}` is 1). Recursion is bounded: every
/// tree it sees comes from the YAML parser, which stops at 128 levels.
fn value_depth(v: &Value) -> usize {
    match v {
        Value::Mapping(m) => 1 + m.values().map(value_depth).max().unwrap_or(0),
        Value::Sequence(s) => 1 + s.iter().map(value_depth).max().unwrap_or(0),
        Value::Tagged(t) => value_depth(&t.value),
        _ => 0,
    }
}

/// The first tagged value (or key) of `v`: its tag and the path of segments to it.
fn find_tag(v: &Value, path: &mut Vec<String>) -> Option<String> {
    match v {
        Value::Tagged(t) => Some(t.tag.to_string()),
        Value::Mapping(m) => {
            for (k, child) in m {
                path.push(key_str(k));
                if let Value::Tagged(t) = k {
                    return Some(t.tag.to_string());
                }
                if let Some(tag) = find_tag(child, path) {
                    return Some(tag);
                }
                path.pop();
            }
            None
        }
        Value::Sequence(s) => {
            for (i, child) in s.iter().enumerate() {
                path.push(i.to_string());
                if let Some(tag) = find_tag(child, path) {
                    return Some(tag);
                }
                path.pop();
            }
            None
        }
        _ => None,
    }
}

/// Flow nesting (`[`, `{`) beyond which a file is refused before parsing. The YAML parser's own
/// limit is 128 levels, but it finds that out in time quadratic in the nesting (60,000 `[` took
/// 15 s); past this depth the tree would be refused anyway ([`MAX_DEPTH`]).
const MAX_FLOW_NESTING: usize = 128;

/// 1-based (line, column) of the first `[` / `{` nested deeper than [`MAX_FLOW_NESTING`], outside
/// quoted strings and comments. One pass over the text.
fn too_deep_flow(text: &str) -> Option<(usize, usize)> {
    let (mut depth, mut line, mut col) = (0usize, 1usize, 0usize);
    let mut quote: Option<char> = None;
    let (mut escaped, mut comment, mut prev) = (false, false, '\n');
    for c in text.chars() {
        col += 1;
        if c == '\n' {
            (line, col, comment) = (line + 1, 0, false);
            // a newline does not end a quoted scalar, but it does end a comment
        } else if comment {
        } else if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if q == '"' && c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
        } else {
            match c {
                '#' if prev.is_whitespace() => comment = true,
                // a quote opens a quoted scalar only where a scalar may start
                '"' | '\'' if prev.is_whitespace() || "[{,:".contains(prev) => quote = Some(c),
                '[' | '{' => {
                    depth += 1;
                    if depth > MAX_FLOW_NESTING {
                        return Some((line, col));
                    }
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        prev = c;
    }
    None
}

/// A parsed file: its tree and the index of its keys.
struct Parsed {
    value: Value,
    index: KeyIndex,
}

/// Context for resolving `extends` paths.
struct Loader {
    cwd: PathBuf,
    /// Every file read so far (each file is read and parsed once).
    files: HashMap<PathBuf, Parsed>,
    /// Includes loaded so far (the top-level file not counted).
    includes: usize,
    /// Mapping keys loaded so far.
    keys: usize,
}

impl Loader {
    fn resolve(&self, written: &str, including: Option<&Path>) -> Result<PathBuf, RecipeError> {
        let p = Path::new(written);
        let mut tried = Vec::new();
        if p.is_absolute() {
            tried.push(p.to_path_buf());
        } else {
            if let Some(dir) = including.and_then(Path::parent) {
                tried.push(dir.join(p));
                tried.push(dir.join("..").join("configs").join(p));
            }
            tried.push(self.cwd.join(p));
            tried.push(self.cwd.join("configs").join(p));
        }
        for t in &tried {
            if t.is_file() {
                return Ok(t.clone());
            }
        }
        Err(RecipeError::NotFound {
            path: written.to_string(),
            tried: tried
                .iter()
                .map(|t| t.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// The position of key `inner` in `file` (or of its nearest written ancestor).
    fn pos(&self, file: &Path, inner: &[String]) -> Option<(usize, usize)> {
        self.files.get(file).and_then(|p| p.index.nearest(inner))
    }

    fn at(&self, file: &Path, inner: &[String]) -> Origin {
        Origin::File {
            path: file.to_path_buf(),
            pos: self.pos(file, inner),
        }
    }

    /// Read, parse and index `path` unless that was done before; then its tree.
    fn parse_file(&mut self, path: &Path) -> Result<Value, RecipeError> {
        if let Some(p) = self.files.get(path) {
            return Ok(p.value.clone());
        }
        let io = |e: std::io::Error| RecipeError::Io {
            path: path.to_path_buf(),
            msg: e.to_string(),
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
            .map_err(io)?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            let size = std::fs::metadata(path).map_or(bytes.len() as u64, |m| m.len());
            return Err(RecipeError::Limit {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: None,
                },
                what: format!(
                    "the file is {size} bytes; recipe files are limited to {MAX_FILE_BYTES} bytes (1 MiB)"
                ),
                fix: "a recipe holds settings, not data: put large data in a dataset file and name its path in the recipe".into(),
            });
        }
        let text = String::from_utf8(bytes).map_err(|e| RecipeError::Io {
            path: path.to_path_buf(),
            msg: format!("not UTF-8 text ({e})"),
        })?;
        if let Some(pos) = too_deep_flow(&text) {
            return Err(RecipeError::Limit {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: Some(pos),
                },
                what: format!(
                    "`[` / `{{` nested more than {MAX_FLOW_NESTING} levels deep; recipes nest at most {MAX_DEPTH} levels"
                ),
                fix: "flatten the nesting (or quote the text if the brackets are part of a string)"
                    .into(),
            });
        }
        let v: Value = if text.trim().is_empty() {
            Value::Mapping(Mapping::new())
        } else {
            serde_norway::from_str(&text).map_err(|e| RecipeError::Syntax {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: e.location().map(|l| (l.line(), l.column())),
                },
                msg: strip_location(&e.to_string()),
            })?
        };
        let index = KeyIndex::build(&text);
        let mut tag_path = Vec::new();
        if let Some(tag) = find_tag(&v, &mut tag_path) {
            return Err(RecipeError::Tag {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: index.nearest(&tag_path).or(Some((1, 1))),
                },
                tag,
                path: tag_path.join("."),
            });
        }
        if !matches!(v, Value::Mapping(_)) {
            return Err(RecipeError::Syntax {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: Some((1, 1)),
                },
                msg: "a recipe must be a YAML mapping (key: value lines)".into(),
            });
        }
        self.files.insert(
            path.to_path_buf(),
            Parsed {
                value: v.clone(),
                index,
            },
        );
        Ok(v)
    }

    /// Load `path` with its `extends`, returning the tree and origins (relative to `prefix`, a
    /// key path `depth` segments deep).
    fn load(
        &mut self,
        path: &Path,
        prefix: &str,
        depth: usize,
        chain: &mut Vec<PathBuf>,
        origins: &mut BTreeMap<String, Origin>,
    ) -> Result<Value, RecipeError> {
        let canon = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        if chain.contains(&canon) {
            let mut names: Vec<String> = chain.iter().map(|p| p.display().to_string()).collect();
            names.push(canon.display().to_string());
            return Err(RecipeError::Cycle {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: None,
                },
                chain: names.join(" -> "),
            });
        }
        chain.push(canon);
        let v = self.parse_file(path)?;
        let out = self.expand(v, path, prefix, depth, &[], chain, origins)?;
        chain.pop();
        Ok(out)
    }

    /// Resolve `extends` inside mapping `v` (located at `inner` below the file's root, which sits
    /// at `prefix`, `depth` segments deep).
    #[allow(clippy::too_many_arguments)]
    fn expand(
        &mut self,
        v: Value,
        file: &Path,
        prefix: &str,
        depth: usize,
        inner: &[String],
        chain: &mut Vec<PathBuf>,
        origins: &mut BTreeMap<String, Origin>,
    ) -> Result<Value, RecipeError> {
        let Value::Mapping(map) = v else {
            return Ok(v);
        };
        let mut base = Value::Mapping(Mapping::new());
        let inner_path: String = inner.join(".");
        let full_prefix = match (prefix.is_empty(), inner_path.is_empty()) {
            (_, true) => prefix.to_string(),
            (true, false) => inner_path.clone(),
            (false, false) => format!("{prefix}.{inner_path}"),
        };
        if let Some(ext) = map.get(Value::String("extends".into())) {
            let list: Vec<String> = match ext {
                Value::String(s) => vec![s.clone()],
                Value::Sequence(seq) => seq
                    .iter()
                    .map(|x| match x {
                        Value::String(s) => Ok(s.clone()),
                        _ => Err(()),
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|_| {
                        self.type_err(
                            file,
                            inner,
                            "extends",
                            "a file path or a list of file paths",
                        )
                    })?,
                _ => {
                    return Err(self.type_err(
                        file,
                        inner,
                        "extends",
                        "a file path or a list of file paths",
                    ));
                }
            };
            for item in list {
                self.includes += 1;
                if self.includes > MAX_INCLUDES {
                    let mut at = inner.to_vec();
                    at.push("extends".into());
                    return Err(RecipeError::Limit {
                        at: self.at(file, &at),
                        what: format!(
                            "more than {MAX_INCLUDES} `extends` includes (the next one is `{item}`); \
                             the same files are included over and over"
                        ),
                        fix: "includes multiply: a file that extends two copies of the next, 30 levels deep, \
                              is a billion includes. Include each shared file once, from the top-level recipe"
                            .into(),
                    });
                }
                let p = self.resolve(&item, Some(file))?;
                let sub = self.load(&p, &full_prefix, depth + inner.len(), chain, origins)?;
                merge(&mut base, sub);
            }
        }
        let mut own = Mapping::new();
        for (k, val) in map {
            let ks = key_str(&k);
            if ks == "extends" {
                continue;
            }
            let mut inner2 = inner.to_vec();
            inner2.push(ks.clone());
            self.keys += 1;
            if self.keys > MAX_KEYS {
                return Err(RecipeError::Limit {
                    at: self.at(file, &inner2),
                    what: format!("more than {MAX_KEYS} keys loaded (over all files and includes)"),
                    fix:
                        "a recipe holds settings, not data: put large data in a dataset file, and \
                          include shared files once"
                            .into(),
                });
            }
            // the key itself, then (for a list) the containers nested in its value
            let key_depth = depth + inner2.len();
            let below = if matches!(val, Value::Mapping(_)) {
                0
            } else {
                value_depth(&val)
            };
            if key_depth + below > MAX_DEPTH {
                return Err(RecipeError::Limit {
                    at: self.at(file, &inner2),
                    what: format!(
                        "`{}` nests {} levels deep; recipes nest at most {MAX_DEPTH} levels",
                        short(&join(&full_prefix, &ks)),
                        key_depth + below
                    ),
                    fix: "flatten the nesting (an `extends:` inside a mapping adds the included file's depth to it)"
                        .into(),
                });
            }
            let val = self.expand(val, file, prefix, depth, &inner2, chain, origins)?;
            origins.insert(join(&full_prefix, &ks), self.at(file, &inner2));
            own.insert(k, val);
        }
        merge(&mut base, Value::Mapping(own));
        Ok(base)
    }

    fn type_err(&self, file: &Path, inner: &[String], key: &str, expected: &str) -> RecipeError {
        let mut p = inner.to_vec();
        p.push(key.to_string());
        RecipeError::Type {
            at: self.at(file, &p),
            path: p.join("."),
            msg: format!("expected {expected}"),
        }
    }
}

fn strip_location(msg: &str) -> String {
    match msg.find(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// Deep-merge `over` into `base`: mappings merge key by key, anything else replaces.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// [`merge`] for JSON trees (the resolved recipe laid over schema defaults).
pub fn merge_json(base: &mut serde_json::Value, over: serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) => merge_json(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// Read a recipe file with its `extends` and apply `--set` overrides.
pub fn load_raw(path: &Path, sets: &[String]) -> Result<RawRecipe, RecipeError> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let mut loader = Loader {
        cwd: cwd.clone(),
        files: HashMap::new(),
        includes: 0,
        keys: 0,
    };
    if !path.is_file() {
        let mut tried = vec![path.display().to_string()];
        if path.is_relative() {
            tried.push(cwd.join(path).display().to_string());
        }
        return Err(RecipeError::NotFound {
            path: path.display().to_string(),
            tried: tried.join(", "),
        });
    }
    let mut origins = BTreeMap::new();
    let mut value = loader.load(path, "", 0, &mut Vec::new(), &mut origins)?;
    for s in sets {
        apply_set(&mut value, &mut origins, s)?;
    }
    Ok(RawRecipe {
        value,
        origins,
        file: Some(path.to_path_buf()),
    })
}

/// Parse and apply one `key.path=value` override.
pub fn apply_set(
    value: &mut Value,
    origins: &mut BTreeMap<String, Origin>,
    arg: &str,
) -> Result<(), RecipeError> {
    let bad = |msg: String| RecipeError::BadSet {
        arg: arg.into(),
        msg,
    };
    let Some((k, v)) = arg.split_once('=') else {
        return Err(bad(
            "expected KEY.PATH=VALUE, e.g. --set optim.lr=3e-4".into()
        ));
    };
    let k = k.trim();
    // counted before anything is split or built, so a 60,000-deep path costs nothing
    let segments = k.split('.').count();
    if segments > MAX_DEPTH {
        return Err(bad(format!(
            "the key path is {segments} levels deep; recipes nest at most {MAX_DEPTH} levels (e.g. --set search.batch.group_size=5)"
        )));
    }
    if k.is_empty() || k.split('.').any(|p| p.trim().is_empty()) {
        return Err(bad("empty key segment; expected KEY.PATH=VALUE".into()));
    }
    let parsed: Value = if v.trim().is_empty() {
        Value::String(String::new())
    } else {
        serde_norway::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()))
    };
    if let Some(tag) = find_tag(&parsed, &mut Vec::new()) {
        return Err(bad(format!(
            "unsupported YAML tag `{tag}` in the value; recipes are plain YAML data: remove the tag"
        )));
    }
    if segments + value_depth(&parsed) > MAX_DEPTH {
        return Err(bad(format!(
            "the value nests {} levels below a {segments}-level key; recipes nest at most {MAX_DEPTH} levels",
            value_depth(&parsed)
        )));
    }
    let parts: Vec<&str> = k.split('.').map(str::trim).collect();
    let mut cur = value;
    for (i, p) in parts.iter().enumerate() {
        if !matches!(cur, Value::Mapping(_)) {
            let at = parts[..i].join(".");
            return Err(bad(format!(
                "`{at}` is not a mapping, so it has no key `{p}`"
            )));
        }
        let Value::Mapping(m) = cur else {
            unreachable!()
        };
        let key = Value::String((*p).to_string());
        if i + 1 == parts.len() {
            m.insert(key, parsed);
            break;
        }
        if !m.contains_key(&key) {
            m.insert(key.clone(), Value::Mapping(Mapping::new()));
        }
        cur = m.get_mut(&key).expect("inserted above");
    }
    origins.insert(k.to_string(), Origin::Set(arg.to_string()));
    Ok(())
}

impl RawRecipe {
    /// Origin of a dotted path: the path itself or its nearest written ancestor.
    pub fn origin(&self, path: &str) -> Origin {
        let mut p = path.to_string();
        loop {
            if let Some(o) = self.origins.get(&p) {
                return o.clone();
            }
            match p.rfind('.') {
                Some(i) => p.truncate(i),
                None => break,
            }
        }
        match &self.file {
            Some(f) => Origin::File {
                path: f.clone(),
                pos: None,
            },
            None => Origin::Default,
        }
    }

    /// The `task:` value.
    pub fn task(&self) -> Result<String, RecipeError> {
        match self.value.get("task") {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(RecipeError::Task {
                at: self.origin("task"),
                msg: "`task:` must be a string naming the task, e.g. `task: grpo_sequence`".into(),
            }),
            None => Err(RecipeError::Task {
                at: self.origin("task"),
                msg: "the recipe has no `task:` key; add e.g. `task: grpo_sequence` (see `kiln recipes`)".into(),
            }),
        }
    }

    /// Deserialize the tree into `T`, mapping serde errors to located recipe errors.
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, RecipeError> {
        let json = yaml_to_json(&self.value);
        match serde_path_to_error::deserialize::<_, T>(json) {
            Ok(v) => Ok(v),
            Err(e) => {
                let path = e.path().to_string();
                let path = if path == "." { String::new() } else { path };
                let msg = e.into_inner().to_string();
                Err(RecipeError::Type {
                    at: self.origin(&path),
                    path,
                    msg,
                })
            }
        }
    }

    /// Reject keys that no schema in `schemas` allows. Each schema is a root struct schema (object
    /// with properties); the union of their top-level properties is allowed at the root.
    pub fn check_keys(&self, schemas: &[schemars::Schema]) -> Result<(), RecipeError> {
        let json = yaml_to_json(&self.value);
        let mut roots: Vec<(&serde_json::Value, &serde_json::Value)> = Vec::new();
        for s in schemas {
            let v = s.as_value();
            roots.push((v, v));
        }
        check_node(self, &json, &roots, "")
    }
}

/// Convert the YAML tree to JSON (non-string keys become their YAML text).
pub fn yaml_to_json(v: &Value) -> serde_json::Value {
    match v {
        Value::Null => serde_json::Value::Null,
        Value::Bool(b) => serde_json::Value::Bool(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i.into()
            } else if let Some(u) = n.as_u64() {
                u.into()
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(serde_json::Value::Number)
                    .unwrap_or(serde_json::Value::String(f.to_string()))
            }
        }
        Value::String(s) => serde_json::Value::String(s.clone()),
        Value::Sequence(s) => serde_json::Value::Array(s.iter().map(yaml_to_json).collect()),
        Value::Mapping(m) => {
            let mut o = serde_json::Map::new();
            for (k, v) in m {
                o.insert(key_str(k), yaml_to_json(v));
            }
            serde_json::Value::Object(o)
        }
        Value::Tagged(t) => yaml_to_json(&t.value),
    }
}

fn resolve_ref<'a>(root: &'a serde_json::Value, s: &'a serde_json::Value) -> &'a serde_json::Value {
    let mut cur = s;
    for _ in 0..16 {
        match cur.get("$ref").and_then(|r| r.as_str()) {
            Some(r) => {
                let Some(ptr) = r.strip_prefix('#') else {
                    return cur;
                };
                match root.pointer(ptr) {
                    Some(t) => cur = t,
                    None => return cur,
                }
            }
            None => return cur,
        }
    }
    cur
}

/// The object schemas (with `properties`) a schema node may stand for.
fn object_variants<'a>(
    root: &'a serde_json::Value,
    s: &'a serde_json::Value,
    out: &mut Vec<(&'a serde_json::Value, &'a serde_json::Value)>,
) -> bool {
    let s = resolve_ref(root, s);
    let mut open = false;
    if s.get("properties").is_some() {
        out.push((root, s));
    } else if s.get("additionalProperties").is_some()
        && s.get("additionalProperties") != Some(&serde_json::Value::Bool(false))
    {
        open = true; // a map with free keys
    }
    for k in ["anyOf", "oneOf", "allOf"] {
        if let Some(arr) = s.get(k).and_then(|a| a.as_array()) {
            for sub in arr {
                open |= object_variants(root, sub, out);
            }
        }
    }
    if s.as_bool() == Some(true) || (s.is_object() && s.as_object().is_some_and(|o| o.is_empty())) {
        open = true; // any value
    }
    open
}

fn check_node(
    raw: &RawRecipe,
    v: &serde_json::Value,
    schemas: &[(&serde_json::Value, &serde_json::Value)],
    path: &str,
) -> Result<(), RecipeError> {
    let serde_json::Value::Object(map) = v else {
        return Ok(());
    };
    let mut variants = Vec::new();
    let mut open = false;
    for (root, s) in schemas {
        open |= object_variants(root, s, &mut variants);
    }
    if variants.is_empty() {
        return Ok(()); // not a struct here (a map, an enum, free JSON): nothing to check
    }
    for (k, child) in map {
        let mut child_schemas = Vec::new();
        for (root, s) in &variants {
            if let Some(ps) = s.get("properties").and_then(|p| p.get(k)) {
                child_schemas.push((*root, ps));
            }
        }
        let full = join(path, k);
        if child_schemas.is_empty() {
            if open {
                continue;
            }
            let mut valid: Vec<String> = variants
                .iter()
                .filter_map(|(_, s)| s.get("properties").and_then(|p| p.as_object()))
                .flat_map(|o| o.keys().cloned())
                .collect();
            valid.sort();
            valid.dedup();
            let best = valid
                .iter()
                .map(|c| (strsim::jaro_winkler(k, c), c))
                .filter(|(s, _)| *s > 0.75)
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, c)| format!(" (did you mean `{}`?)", join(path, c)))
                .unwrap_or_default();
            return Err(RecipeError::UnknownKey {
                at: raw.origin(&full),
                path: full,
                suggestion: best,
                valid: valid.join(", "),
            });
        }
        check_node(raw, child, &child_schemas, &full)?;
    }
    Ok(())
}

/// A schema for `T` with doc comments as descriptions.
pub fn schema_of<T: JsonSchema>() -> schemars::Schema {
    schemars::schema_for!(T)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_keys() {
        let t = "task: x\ntrainer:\n  steps: 10\n  # c\n  ppo_epochs: 2\noptim:\n  lr: 1e-3\n";
        let ix = KeyIndex::build(t);
        assert_eq!(ix.get(&["trainer", "ppo_epochs"]), Some((5, 15)));
        assert_eq!(ix.get(&["optim", "lr"]), Some((7, 7)));
        assert_eq!(ix.get(&["optim", "steps"]), None);
        assert_eq!(ix.get(&["trainer", "steps"]), Some((3, 10)));
        assert_eq!(ix.nearest(&["optim", "lr", "0"]), Some((7, 7)));
        assert_eq!(ix.get::<&str>(&[]), None);
    }

    #[test]
    fn index_handles_lists_and_repeated_keys() {
        let t = "a:\n  - b: 1\n    c: 2\nd:\n  b: 3\n";
        let ix = KeyIndex::build(t);
        assert_eq!(ix.get(&["a", "b"]), Some((2, 8)));
        assert_eq!(ix.get(&["a", "c"]), Some((3, 8)));
        assert_eq!(ix.get(&["d", "b"]), Some((5, 6)));
        assert_eq!(ix.get(&["b"]), None);
    }

    #[test]
    fn set_creates_paths_and_parses_yaml_scalars() {
        let mut v: Value = serde_norway::from_str("a: {b: 1}").unwrap();
        let mut o = BTreeMap::new();
        apply_set(&mut v, &mut o, "a.c.d=0.5").unwrap();
        apply_set(&mut v, &mut o, "a.b=true").unwrap();
        assert_eq!(v["a"]["c"]["d"], Value::from(0.5));
        assert_eq!(v["a"]["b"], Value::Bool(true));
        assert!(apply_set(&mut v, &mut o, "a.b.x=1").is_err());
        assert!(apply_set(&mut v, &mut o, "novalue").is_err());
    }

    #[test]
    fn set_refuses_deep_paths_deep_values_and_tags() {
        let mut v = Value::Mapping(Mapping::new());
        let mut o = BTreeMap::new();
        let deep = format!("{}=1", vec!["a"; 60_000].join("."));
        let err = apply_set(&mut v, &mut o, &deep).unwrap_err().to_string();
        assert!(err.contains("60000 levels deep"), "{err}");
        assert!(err.len() < 400, "the argument is shortened: {err}");
        let ok = format!("{}=1", vec!["a"; MAX_DEPTH].join("."));
        apply_set(&mut v, &mut o, &ok).unwrap();
        let nested = format!("x={}1{}", "[".repeat(40), "]".repeat(40));
        let err = apply_set(&mut v, &mut o, &nested).unwrap_err().to_string();
        assert!(err.contains("nests"), "{err}");
        let err = apply_set(&mut v, &mut o, "x=!evil 5")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tag `!evil`"), "{err}");
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn unknown_tags_are_refused_with_their_line() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "r.yaml", "task: x\ntrainer:\n  steps: !evil 5\n");
        let err = load_raw(&p, &[]).unwrap_err().to_string();
        assert!(err.contains("r.yaml:3:"), "{err}");
        assert!(
            err.contains("tag `!evil`") && err.contains("trainer.steps"),
            "{err}"
        );
        let p = write(
            d.path(),
            "l.yaml",
            "task: x\nmodes:\n  - direct\n  - !evil rag\n",
        );
        let err = load_raw(&p, &[]).unwrap_err().to_string();
        assert!(
            err.contains("l.yaml:2:") && err.contains("modes.1"),
            "{err}"
        );
    }

    #[test]
    fn extends_fan_out_stops_at_the_include_limit() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..30 {
            write(
                d.path(),
                &format!("f{i}.yaml"),
                &format!("k{i}: 1\nextends: [f{n}.yaml, f{n}.yaml]\n", n = i + 1),
            );
        }
        write(d.path(), "f30.yaml", "leaf: 1\n");
        let err = load_raw(&d.path().join("f0.yaml"), &[]).unwrap_err();
        assert!(matches!(err, RecipeError::Limit { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("more than 256 `extends` includes"), "{msg}");
        assert!(
            msg.contains(".yaml:2:"),
            "points at the extends line: {msg}"
        );
    }

    #[test]
    fn nesting_through_extends_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        // each file puts the next one 20 levels further down: 2 files are over the limit
        let down = |next: &str| {
            let mut s = String::new();
            for i in 0..20 {
                s.push_str(&format!("{}k{i}:\n", "  ".repeat(i)));
            }
            s.push_str(&format!("{}extends: {next}\n", "  ".repeat(20)));
            s
        };
        write(d.path(), "a.yaml", &down("b.yaml"));
        write(d.path(), "b.yaml", &down("c.yaml"));
        write(d.path(), "c.yaml", "leaf: 1\n");
        let err = load_raw(&d.path().join("a.yaml"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("recipes nest at most 32 levels"), "{err}");
        assert!(err.contains("b.yaml:"), "{err}");
    }

    #[test]
    fn deep_flow_nesting_is_refused_before_parsing() {
        let d = tempfile::tempdir().unwrap();
        let deep = format!("task: x\nx: {}{}\n", "[".repeat(60_000), "]".repeat(60_000));
        let p = write(d.path(), "deep.yaml", &deep);
        let err = load_raw(&p, &[]).unwrap_err().to_string();
        assert!(
            err.contains("deep.yaml:2:132") && err.contains("nested more than 128"),
            "{err}"
        );
        // brackets in strings and comments do not count
        let text = format!(
            "a: \"{}\"\nb: '{}' # {}\n",
            "[".repeat(200),
            "{".repeat(200),
            "[".repeat(200)
        );
        assert_eq!(too_deep_flow(&text), None);
    }

    #[test]
    fn large_files_are_refused_before_parsing() {
        let d = tempfile::tempdir().unwrap();
        let big = format!("task: x\nd: \"{}\"\n", "x".repeat(MAX_FILE_BYTES as usize));
        let p = write(d.path(), "big.yaml", &big);
        let err = load_raw(&p, &[]).unwrap_err().to_string();
        assert!(
            err.contains("big.yaml") && err.contains("limited to 1048576 bytes"),
            "{err}"
        );
    }

    #[test]
    fn many_keys_load_and_are_located() {
        let d = tempfile::tempdir().unwrap();
        let mut t = String::from("task: x\nm:\n");
        for i in 0..20_000 {
            t.push_str(&format!("  k{i}: {i}\n"));
        }
        let p = write(d.path(), "many.yaml", &t);
        let raw = load_raw(&p, &[]).unwrap();
        assert_eq!(
            raw.origin("m.k19999").to_string(),
            format!("{}:20002:11", p.display())
        );
    }
}
