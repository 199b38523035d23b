//! `kiln doctor`: what this machine and this build have, and lack, for each backend and recipe.
//!
//! Everything here is a read of the machine (`/proc`, the library and Vulkan driver folders, the
//! `.kiln/models.json` registries, the shared data folder) plus a validation of each recipe; it
//! starts no device and loads no weights, so it answers in well under a second. Each missing
//! piece is printed with the command that supplies it. The exit status is 0 even when something
//! is missing (a CPU-only machine is a normal machine); it is 1 only when it cannot run at all.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::config::Backend;
use crate::{recipe, tasks};

/// `kiln doctor` arguments.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Recipes to check (every `*.yaml` here).
    #[arg(long, default_value = "recipes")]
    pub recipes: PathBuf,
    /// The shared evaluation data (`../shared/datasets`, as the search recipes' `datasets_root`).
    #[arg(long, default_value = "../shared/datasets")]
    pub data: PathBuf,
}

/// Whether this binary was built with the wgpu / cuda backends.
const WGPU_BUILT: bool = cfg!(feature = "wgpu");
const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Folders the dynamic loader searches on common Linux distributions, then `LD_LIBRARY_PATH`.
fn library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/lib/x86_64-linux-gnu",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

fn find_library(name: &str) -> Option<PathBuf> {
    library_dirs()
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
}

/// Vulkan driver manifests (ICDs): `VK_DRIVER_FILES` / `VK_ICD_FILENAMES`, else the standard folders.
fn vulkan_icds() -> Vec<String> {
    for var in ["VK_DRIVER_FILES", "VK_ICD_FILENAMES"] {
        if let Some(v) = std::env::var_os(var) {
            return std::env::split_paths(&v)
                .filter(|p| p.exists())
                .map(|p| p.display().to_string())
                .collect();
        }
    }
    let mut out = Vec::new();
    for d in [
        "/usr/share/vulkan/icd.d",
        "/etc/vulkan/icd.d",
        "/usr/local/share/vulkan/icd.d",
    ] {
        if let Ok(rd) = std::fs::read_dir(d) {
            let mut names: Vec<String> = rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect();
            names.sort();
            out.extend(names);
        }
    }
    out
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn memory_gib() -> Option<f64> {
    let t = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = t
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / (1024.0 * 1024.0))
}

/// The SIMD levels the CPU reports (burn-flex's gemm picks its kernels at run time from these).
fn simd_features() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![
            ("sse4.2", std::arch::is_x86_feature_detected!("sse4.2")),
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ]
    }
    #[cfg(target_arch = "aarch64")]
    {
        vec![("neon", std::arch::is_aarch64_feature_detected!("neon"))]
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Vec::new()
    }
}

/// The f32 matmul kernels burn-flex's gemm dispatches to on this CPU. Every build carries the
/// AVX-512 kernels (burn's `x86-v4` feature is on in the workspace) next to the FMA (AVX2) ones
/// and the portable fallback; gemm checks the CPU once at run time, so one binary runs
/// everywhere and is fast where the CPU allows.
fn matmul_kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            "AVX-512 (x86-64-v4)"
        } else if std::arch::is_x86_feature_detected!("fma") {
            "AVX2 + FMA (x86-64-v3)"
        } else {
            "portable (SSE2)"
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "portable"
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// The backend line of a recipe: `Ok` when this build and machine can run it.
fn backend_need(b: Backend) -> Result<(), String> {
    match b {
        Backend::Cpu => Ok(()),
        Backend::Wgpu if !WGPU_BUILT => {
            Err("backend wgpu is not built in: `just build-wgpu`".into())
        }
        Backend::Wgpu if find_library("libvulkan.so.1").is_none() => Err(
            "backend wgpu needs the Vulkan loader (libvulkan.so.1; Debian: apt install libvulkan1 \
             mesa-vulkan-drivers)"
                .into(),
        ),
        Backend::Cuda if !CUDA_BUILT => Err(
            "backend cuda is not built in: `cargo build --release -p kiln-cli --features cuda`"
                .into(),
        ),
        Backend::Cuda if find_library("libcuda.so.1").is_none() => {
            Err("backend cuda needs the NVIDIA driver (libcuda.so.1 not found)".into())
        }
        _ => Ok(()),
    }
}

/// Every string value under a key named `key`, at any depth of the resolved recipe.
fn values_of<'a>(v: &'a serde_json::Value, key: &str, out: &mut Vec<&'a str>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                if k == key
                    && let Some(s) = x.as_str()
                {
                    out.push(s);
                }
                values_of(x, key, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| values_of(x, key, out)),
        _ => {}
    }
}

/// What a validated recipe needs that is missing here (empty = ready to run).
fn recipe_needs(resolved: &serde_json::Value) -> Vec<String> {
    let mut needs = Vec::new();
    let backend: Backend = resolved
        .get("backend")
        .cloned()
        .and_then(|b| serde_json::from_value(b).ok())
        .unwrap_or_default();
    if let Err(e) = backend_need(backend) {
        needs.push(e);
    }
    for key in ["pretrained", "judge_model", "model_path"] {
        let mut specs = Vec::new();
        values_of(resolved, key, &mut specs);
        for spec in specs.into_iter().filter(|s| !s.is_empty()) {
            if let Err(e) = kiln_lm::zoo::resolve(spec) {
                needs.push(format!("`{key}: {spec}`: {e}"));
            }
        }
    }
    let mut retrievers = Vec::new();
    values_of(resolved, "retriever", &mut retrievers);
    let mut locals: Vec<kiln_retrieval::LocalRetrieverConfig> = retrievers
        .into_iter()
        .filter(|r| !(r.is_empty() || *r == "synthetic"))
        .filter_map(kiln_retrieval::LocalRetrieverConfig::parse)
        .collect();
    if let Some(m) = resolved.get("retriever").filter(|v| v.is_object())
        && let Ok(c) = serde_json::from_value(m.clone())
    {
        locals.push(c);
    }
    for c in locals {
        let dense = c.kind != kiln_retrieval::RetrieverKind::Bm25;
        if !c.index.is_dir() {
            needs.push(format!(
                "`retriever: {}:{}`: no such index folder (build one with `kiln index{}`)",
                c.kind,
                c.index.display(),
                if dense { " --dense" } else { "" }
            ));
        } else if dense && kiln_retrieval::dense::read_meta(&c.index).is_err() {
            needs.push(format!(
                "`retriever: {}:{}`: the index has no dense part (rebuild it with `kiln index ... --dense`)",
                c.kind,
                c.index.display()
            ));
        }
    }
    // A cold start with real-data demonstrations (`warm_start.real`) searches its own index.
    if let Some(real) = resolved
        .pointer("/warm_start/real")
        .filter(|v| v.is_object())
    {
        let index = real.get("index").and_then(|v| v.as_str()).unwrap_or("");
        if !index.is_empty() && !Path::new(index).is_dir() {
            needs.push(format!(
                "`warm_start.real.index: {index}`: no such index folder (for the shared corpus: `just \
                 index-wiki`; otherwise `kiln index --corpus CORPUS --out {index}`)"
            ));
        }
    }
    let uses_named_data = ["train_data", "eval_data"].iter().any(|k| {
        let mut v = Vec::new();
        values_of(resolved, k, &mut v);
        v.iter()
            .any(|d| !d.is_empty() && *d != "synthetic" && !Path::new(d).exists())
    }) || resolved
        .pointer("/warm_start/real/questions")
        .and_then(|v| v.as_str())
        .is_some_and(|d| !d.is_empty() && !Path::new(d).exists());
    if uses_named_data {
        let mut roots = Vec::new();
        values_of(resolved, "datasets_root", &mut roots);
        for root in roots {
            if !Path::new(root).is_dir() {
                needs.push(format!(
                    "`datasets_root: {root}`: not found (the shared datasets; see the README)"
                ));
            }
        }
    }
    needs
}

/// The report of `kiln doctor` as text.
pub fn report(args: &DoctorArgs) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "kiln {} ({} build; backends built in: cpu{}{})",
        env!("CARGO_PKG_VERSION"),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        if WGPU_BUILT { ", wgpu" } else { "" },
        if CUDA_BUILT { ", cuda" } else { "" },
    );

    let _ = writeln!(o, "\nmachine");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = writeln!(o, "  cpu        {} ({threads} threads)", cpu_model());
    if let Some(g) = memory_gib() {
        let _ = writeln!(o, "  memory     {g:.1} GiB");
    }
    let simd = simd_features();
    if !simd.is_empty() {
        let list: Vec<String> = simd
            .iter()
            .map(|(n, b)| format!("{n} {}", yes(*b)))
            .collect();
        let _ = writeln!(
            o,
            "  simd       {} (burn-flex picks its matmul kernels at run time)",
            list.join(", ")
        );
    }
    let _ = writeln!(o, "  matmul     {} kernels", matmul_kernels());
    match std::env::var("RAYON_NUM_THREADS") {
        Ok(n) => {
            let _ = writeln!(o, "  threads    RAYON_NUM_THREADS={n}");
        }
        Err(_) => {
            let _ = writeln!(
                o,
                "  threads    {threads} (set RAYON_NUM_THREADS to run jobs side by side)"
            );
        }
    }

    let _ = writeln!(o, "\nbackends");
    let _ = writeln!(o, "  cpu        ready (burn-flex)");
    let vulkan = find_library("libvulkan.so.1");
    let icds = vulkan_icds();
    let vk = match (&vulkan, icds.is_empty()) {
        (Some(p), false) => format!(
            "Vulkan loader {}, drivers: {}",
            p.display(),
            icds.join(", ")
        ),
        (Some(p), true) => format!(
            "Vulkan loader {}, but no driver manifest (ICD)",
            p.display()
        ),
        (None, _) => "no Vulkan loader (libvulkan.so.1; Debian: apt install libvulkan1 \
                      mesa-vulkan-drivers)"
            .into(),
    };
    let _ = writeln!(
        o,
        "  wgpu       {}; {vk}",
        if WGPU_BUILT {
            "built in"
        } else {
            "not built in (`just build-wgpu`)"
        }
    );
    let cuda = find_library("libcuda.so.1");
    let gpu = Path::new("/dev/nvidia0").exists();
    let _ = writeln!(
        o,
        "  cuda       {}; driver {}, GPU device {}",
        if CUDA_BUILT {
            "built in"
        } else {
            "not built in (`--features cuda`)"
        },
        cuda.map_or("not found (libcuda.so.1)".to_string(), |p| p
            .display()
            .to_string()),
        if gpu { "/dev/nvidia0" } else { "none" }
    );

    let _ = writeln!(o, "\nmodels (.kiln/models.json)");
    let models = kiln_lm::zoo::recorded();
    if models.is_empty() {
        let _ = writeln!(
            o,
            "  none recorded: `just setup` installs smollm2-135m (SmolLM2-135M-Instruct)"
        );
    }
    for (name, path, _) in &models {
        let state = match std::fs::metadata(path) {
            Ok(m) if m.is_file() => format!("{:.0} MB", m.len() as f64 / 1e6),
            Ok(_) => "folder".into(),
            Err(_) => "MISSING: run `just setup` again".into(),
        };
        let _ = writeln!(o, "  {name:<14} {} ({state})", path.display());
    }

    let _ = writeln!(o, "\ndata");
    if args.data.is_dir() {
        let mut subs: Vec<String> = std::fs::read_dir(&args.data)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        subs.sort();
        let _ = writeln!(
            o,
            "  shared     {} ({})",
            args.data.display(),
            if subs.is_empty() {
                "empty".to_string()
            } else {
                subs.join(", ")
            }
        );
    } else {
        let _ = writeln!(
            o,
            "  shared     {} not found: the real-data evaluations and tests need it (synthetic \
             data is generated on first use)",
            args.data.display()
        );
    }

    let _ = writeln!(o, "\nrecipes ({})", args.recipes.display());
    let files: Vec<PathBuf> = explain_files(&args.recipes);
    if files.is_empty() {
        let _ = writeln!(o, "  no *.yaml recipes here (--recipes DIR)");
    }
    for f in files {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let verdict = match recipe::load_raw(&f, &[]).and_then(|raw| tasks::validate(&raw)) {
            Err(e) => format!(
                "INVALID: {}",
                e.to_string().lines().next().unwrap_or_default()
            ),
            Ok(resolved) => {
                let needs = recipe_needs(&resolved);
                if needs.is_empty() {
                    "ready".into()
                } else {
                    format!("needs {}", needs.join("; "))
                }
            }
        };
        let _ = writeln!(o, "  {name:<28} {verdict}");
    }
    o
}

fn explain_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// `kiln doctor`.
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    print!("{}", report(&args));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_recipe_without_models_needs_nothing() {
        let r = serde_json::json!({"backend": "cpu", "pretrained": "", "retriever": "synthetic"});
        assert!(recipe_needs(&r).is_empty());
    }

    #[test]
    fn dense_and_hybrid_retrievers_need_a_dense_index() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        for r in [
            serde_json::json!({"retriever": "hybrid:/nonexistent/idx"}),
            serde_json::json!({"retriever": {"kind": "dense", "index": "/nonexistent/idx"}}),
        ] {
            let needs = recipe_needs(&r);
            assert!(
                needs.len() == 1 && needs[0].contains("--dense"),
                "{needs:?}"
            );
        }
        // An existing folder without dense/dense.json: named, with the rebuild command.
        let needs = recipe_needs(&serde_json::json!({"retriever": format!("dense:{d}")}));
        assert!(
            needs.len() == 1 && needs[0].contains("no dense part"),
            "{needs:?}"
        );
        // BM25 over an existing folder needs nothing more.
        assert!(recipe_needs(&serde_json::json!({"retriever": d})).is_empty());
    }

    #[test]
    fn missing_model_index_and_backend_are_named_with_the_fix() {
        let r = serde_json::json!({
            "backend": "cuda",
            "pretrained": "/nonexistent/model-folder",
            "retriever": "/nonexistent/index",
            "train_data": "hotpotqa",
            "datasets_root": "/nonexistent/shared",
        });
        let needs = recipe_needs(&r).join("\n");
        if !CUDA_BUILT {
            assert!(needs.contains("--features cuda"), "{needs}");
        }
        assert!(needs.contains("/nonexistent/model-folder"), "{needs}");
        assert!(needs.contains("kiln index"), "{needs}");
        assert!(needs.contains("/nonexistent/shared"), "{needs}");
    }

    #[test]
    fn a_real_data_cold_start_needs_its_index_and_questions() {
        let r = serde_json::json!({
            "retriever": "synthetic",
            "train_data": "synthetic",
            "datasets_root": "/nonexistent/shared",
            "warm_start": {"real": {"questions": "train_questions_8k", "index": "/nonexistent/wiki"}},
        });
        let needs = recipe_needs(&r).join("\n");
        assert!(
            needs.contains("warm_start.real.index: /nonexistent/wiki"),
            "{needs}"
        );
        assert!(needs.contains("just index-wiki"), "{needs}");
        assert!(needs.contains("/nonexistent/shared"), "{needs}");
        // Without `real` the same recipe needs nothing.
        let plain = serde_json::json!({"retriever": "synthetic", "train_data": "synthetic"});
        assert!(
            recipe_needs(&plain).is_empty(),
            "{:?}",
            recipe_needs(&plain)
        );
    }
}
