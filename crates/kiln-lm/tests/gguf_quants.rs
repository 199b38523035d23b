//! GGUF dequantisation against the `gguf` Python package (fixture from
//! `scripts/lm/make_gguf_quant_fixture.py`): one tensor per supported ggml type.

use std::collections::HashMap;
use std::path::Path;

use kiln_lm::gguf::GgufFile;
use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    shape: Vec<usize>,
    values: HashMap<String, Vec<f32>>,
}

#[test]
fn every_supported_type_dequantises_like_gguf_py() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf");
    let exp: Expected =
        serde_json::from_str(&std::fs::read_to_string(dir.join("quants_expected.json")).unwrap())
            .unwrap();
    let file = GgufFile::open(dir.join("quants.gguf")).unwrap();
    let mut names: Vec<&String> = exp.values.keys().collect();
    names.sort();
    assert_eq!(names.len(), 8, "{names:?}");
    for name in names {
        let (shape, got) = file.read_f32(name).unwrap();
        assert_eq!(shape, exp.shape, "{name}");
        let want = &exp.values[name];
        let scale = want.iter().fold(0f32, |a, b| a.max(b.abs())).max(1e-6);
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * scale,
                "{name}[{i}]: kiln {a} vs gguf-py {b}"
            );
        }
    }
}
