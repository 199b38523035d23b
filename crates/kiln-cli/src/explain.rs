//! `kiln recipes` and `kiln recipes --explain TASK`: list recipes and document every field.

use std::path::Path;

use serde_json::Value;

fn resolve<'a>(root: &'a Value, s: &'a Value) -> &'a Value {
    let mut cur = s;
    for _ in 0..16 {
        match cur
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix('#'))
        {
            Some(ptr) => match root.pointer(ptr) {
                Some(t) => cur = t,
                None => break,
            },
            None => break,
        }
    }
    cur
}

fn type_name(root: &Value, s: &Value) -> String {
    let s = resolve(root, s);
    if let Some(vals) = s.get("enum").and_then(Value::as_array) {
        return vals
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string())
            })
            .collect::<Vec<_>>()
            .join(" | ");
    }
    if let Some(c) = s.get("const") {
        return c
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| c.to_string());
    }
    for k in ["oneOf", "anyOf"] {
        if let Some(arr) = s.get(k).and_then(Value::as_array) {
            let parts: Vec<String> = arr
                .iter()
                .map(|x| type_name(root, x))
                .filter(|t| t != "null")
                .collect();
            let opt = arr.iter().any(|x| type_name(root, x) == "null");
            let joined = parts.join(" | ");
            return if opt {
                format!("{joined} (optional)")
            } else {
                joined
            };
        }
    }
    match s.get("type") {
        Some(Value::String(t)) => {
            if t == "array" {
                let item = s
                    .get("items")
                    .map(|i| type_name(root, i))
                    .unwrap_or_default();
                format!("list of {item}")
            } else {
                t.clone()
            }
        }
        Some(Value::Array(ts)) => {
            let names: Vec<&str> = ts
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect();
            let opt = ts.iter().any(|t| t.as_str() == Some("null"));
            format!(
                "{}{}",
                names.join(" | "),
                if opt { " (optional)" } else { "" }
            )
        }
        _ => "any".into(),
    }
}

fn first_line(s: &str) -> String {
    s.split("\n\n").next().unwrap_or("").replace('\n', " ")
}

fn walk(root: &Value, s: &Value, prefix: &str, defaults: Option<&Value>, out: &mut String) {
    let s = resolve(root, s);
    let Some(props) = s.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (k, ps) in props {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        let target = resolve(root, ps);
        let default = ps
            .get("default")
            .or_else(|| defaults.and_then(|d| d.get(k)));
        let desc = ps
            .get("description")
            .or_else(|| target.get("description"))
            .and_then(Value::as_str)
            .map(first_line)
            .unwrap_or_default();
        let nested = target.get("properties").is_some();
        if nested {
            out.push_str(&format!("\n{path}:  {desc}\n"));
            walk(root, target, &path, default, out);
        } else {
            let d = default
                .map(|d| serde_json::to_string(d).unwrap_or_default())
                .unwrap_or_else(|| "-".into());
            out.push_str(&format!(
                "  {path}: {}  [default: {d}]\n      {desc}\n",
                type_name(root, ps)
            ));
        }
    }
}

/// Human-readable documentation of every field of the given schemas.
pub fn explain(schemas: &[schemars::Schema]) -> String {
    let mut out = String::new();
    for s in schemas {
        let root = s.as_value();
        walk(root, root, "", root.get("default"), &mut out);
    }
    out
}

/// `(file, description)` of every recipe in `dir`.
pub fn list_recipes(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut files: Vec<_> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    for p in files {
        let desc = match std::fs::read_to_string(&p)
            .ok()
            .and_then(|t| serde_norway::from_str::<serde_norway::Value>(&t).ok())
        {
            Some(v) => {
                let task = v
                    .get("task")
                    .and_then(|t| t.as_str())
                    .unwrap_or("?")
                    .to_string();
                let d = v
                    .get("description")
                    .and_then(|d| d.as_str())
                    .unwrap_or("(no description)")
                    .to_string();
                format!("[{task}] {d}")
            }
            None => "(not valid YAML)".into(),
        };
        out.push((p.display().to_string(), desc));
    }
    out
}
