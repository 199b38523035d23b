//! Recipes: YAML files with a top-level `task:`, `extends:` includes and dotted `--set` overrides.
//!
//! Loading goes: read + parse every file (syntax errors carry file:line:column) -> resolve `extends`
//! (allowed at any mapping level; the included file is merged at that level, the including mapping
//! wins) -> apply `--set a.b=value` (value parsed as YAML) -> check every key against the JSON schema
//! of the task's config structs (unknown keys are rejected with their full path and a "did you mean")
//! -> deserialize into the typed structs (type errors carry the file:line:column where the value was
//! written) -> semantic validation. Provenance of every key (file or `--set`) is tracked through the
//! merge so errors point at the place a user has to edit.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_norway::{Mapping, Value};

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
            Origin::Set(s) => write!(f, "--set {s}"),
            Origin::Default => write!(f, "(default)"),
        }
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
    #[error("--set {arg}: {msg}")]
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

fn join(prefix: &str, key: &str) -> String {
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

/// Locate `path` (dotted keys) in block-style YAML text: 1-based (line, column of the value).
pub fn find_key_position(text: &str, path: &[&str]) -> Option<(usize, usize)> {
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut best: Option<(usize, usize)> = None;
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
        stack.push((indent, key.to_string()));
        if stack.len() == path.len() && stack.iter().zip(path).all(|((_, k), p)| k == p) {
            let after = &rest[colon + 1..];
            let vcol = after.len() - after.trim_start().len();
            let col = if after.trim().is_empty() {
                indent + 1
            } else {
                indent + colon + 1 + vcol + 1
            };
            best = Some((ln + 1, col));
        }
    }
    best
}

/// Context for resolving `extends` paths.
struct Loader {
    cwd: PathBuf,
    texts: BTreeMap<PathBuf, String>,
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

    fn parse_file(&mut self, path: &Path) -> Result<Value, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|e| RecipeError::Io {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
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
        self.texts.insert(path.to_path_buf(), text);
        if !matches!(v, Value::Mapping(_)) {
            return Err(RecipeError::Syntax {
                at: Origin::File {
                    path: path.to_path_buf(),
                    pos: Some((1, 1)),
                },
                msg: "a recipe must be a YAML mapping (key: value lines)".into(),
            });
        }
        Ok(v)
    }

    /// Load `path` with its `extends`, returning the tree and origins (relative to `prefix`).
    fn load(
        &mut self,
        path: &Path,
        prefix: &str,
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
        let out = self.expand(v, path, prefix, &[], chain, origins)?;
        chain.pop();
        Ok(out)
    }

    /// Resolve `extends` inside mapping `v` (located at `inner` below the file's root).
    fn expand(
        &mut self,
        v: Value,
        file: &Path,
        prefix: &str,
        inner: &[String],
        chain: &mut Vec<PathBuf>,
        origins: &mut BTreeMap<String, Origin>,
    ) -> Result<Value, RecipeError> {
        let Value::Mapping(map) = v else {
            return Ok(v);
        };
        let here = |origins: &BTreeMap<String, Origin>| origins.len();
        let _ = here;
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
                let p = self.resolve(&item, Some(file))?;
                let sub = self.load(&p, &full_prefix, chain, origins)?;
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
            let val = self.expand(val, file, prefix, &inner2, chain, origins)?;
            self.record_origins(&val, &join(&full_prefix, &ks), file, &inner2, origins);
            own.insert(k, val);
        }
        merge(&mut base, Value::Mapping(own));
        Ok(base)
    }

    fn record_origins(
        &self,
        v: &Value,
        full: &str,
        file: &Path,
        inner: &[String],
        origins: &mut BTreeMap<String, Origin>,
    ) {
        let refs: Vec<&str> = inner.iter().map(String::as_str).collect();
        let pos = self
            .texts
            .get(file)
            .and_then(|t| find_key_position(t, &refs));
        origins.insert(
            full.to_string(),
            Origin::File {
                path: file.to_path_buf(),
                pos,
            },
        );
        let _ = v;
    }

    fn type_err(&self, file: &Path, inner: &[String], key: &str, expected: &str) -> RecipeError {
        let mut p: Vec<&str> = inner.iter().map(String::as_str).collect();
        p.push(key);
        let pos = self.texts.get(file).and_then(|t| find_key_position(t, &p));
        RecipeError::Type {
            at: Origin::File {
                path: file.to_path_buf(),
                pos,
            },
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

/// Read a recipe file with its `extends` and apply `--set` overrides.
pub fn load_raw(path: &Path, sets: &[String]) -> Result<RawRecipe, RecipeError> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let mut loader = Loader {
        cwd: cwd.clone(),
        texts: BTreeMap::new(),
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
    let mut value = loader.load(path, "", &mut Vec::new(), &mut origins)?;
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
    let Some((k, v)) = arg.split_once('=') else {
        return Err(RecipeError::BadSet {
            arg: arg.into(),
            msg: "expected KEY.PATH=VALUE, e.g. --set optim.lr=3e-4".into(),
        });
    };
    let k = k.trim();
    if k.is_empty() || k.split('.').any(|p| p.trim().is_empty()) {
        return Err(RecipeError::BadSet {
            arg: arg.into(),
            msg: "empty key segment; expected KEY.PATH=VALUE".into(),
        });
    }
    let parsed: Value = if v.trim().is_empty() {
        Value::String(String::new())
    } else {
        serde_norway::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()))
    };
    let parts: Vec<&str> = k.split('.').map(str::trim).collect();
    let mut cur = value;
    for (i, p) in parts.iter().enumerate() {
        if !matches!(cur, Value::Mapping(_)) {
            let at = parts[..i].join(".");
            return Err(RecipeError::BadSet {
                arg: arg.into(),
                msg: format!("`{at}` is not a mapping, so it has no key `{p}`"),
            });
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
        assert_eq!(
            find_key_position(t, &["trainer", "ppo_epochs"]),
            Some((5, 15))
        );
        assert_eq!(find_key_position(t, &["optim", "lr"]), Some((7, 7)));
        assert_eq!(find_key_position(t, &["optim", "steps"]), None);
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
}
