//! `normalize_answer`, `f1_score` and `extract_answer` agree with the Python reference (SQuAD's normalisation as
//! used by Search-R1, and Search-R1's last-`<answer>` regex) on thousands of random strings built from tricky
//! characters. Needs only the Python standard library, run by `<repo>/.venv/bin/python` (or `$KILN_PYTHON`).

use std::path::PathBuf;
use std::process::Command;

use kiln_search::answer::{answer_spans, f1_score, normalize_answer};
use rand::{Rng, SeedableRng};

const REFERENCE: &str = r#"
import collections, json, re, string, sys
def normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)
    def white_space_fix(text):
        return " ".join(text.split())
    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)
    return white_space_fix(remove_articles(remove_punc(s.lower())))
def f1(p, g):
    pt, gt = normalize_answer(p).split(), normalize_answer(g).split()
    same = sum((collections.Counter(pt) & collections.Counter(gt)).values())
    if same == 0:
        return 0.0
    pr, rc = same / len(pt), same / len(gt)
    return 2 * pr * rc / (pr + rc)
cases = json.load(open(sys.argv[1], encoding="utf-8"))
out = []
for s, g in cases:
    spans = [m.group(1) for m in re.finditer(r"<answer>(.*?)</answer>", s, re.DOTALL)]
    out.append([normalize_answer(s), f1(s, g), spans])
json.dump(out, open(sys.argv[2], "w", encoding="utf-8"))
"#;

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KILN_PYTHON") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        p.is_file(),
        "{} is missing: run `just setup-test` (or set KILN_PYTHON) to create the test virtualenv",
        p.display()
    );
    p
}

const PIECES: &[&str] = &[
    "a",
    "an",
    "the",
    "The",
    "A",
    "AN",
    "thé",
    "é",
    "Σ",
    "ΣΟΦΟΣ",
    "İ",
    "ß",
    "ﬁ",
    "½",
    "①",
    "Ⓐ",
    "_",
    "-",
    ".",
    ",",
    "'",
    "\"",
    "“",
    "”",
    "—",
    "!",
    "?",
    "(",
    ")",
    "$",
    "%",
    " ",
    "  ",
    "\t",
    "\n",
    "\u{a0}",
    "\u{2003}",
    "\u{1c}",
    "\u{85}",
    "\u{301}",
    "日本",
    "東京",
    "1",
    "42",
    "3.5",
    "x",
    "Paris",
    "paris",
    "cat",
    "<answer>",
    "</answer>",
    "<search>",
    "ɐ",
    "Ǆ",
    "ǅ",
    "ﾞ",
    "٣",
    "\u{200b}",
];

#[test]
fn agrees_with_python_reference() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2024);
    let make = |rng: &mut rand_chacha::ChaCha8Rng| -> String {
        let n = rng.random_range(0..12);
        (0..n)
            .map(|_| PIECES[rng.random_range(0..PIECES.len())])
            .collect()
    };
    let cases: Vec<(String, String)> = (0..5000)
        .map(|_| (make(&mut rng), make(&mut rng)))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let (inp, out, script) = (
        dir.path().join("in.json"),
        dir.path().join("out.json"),
        dir.path().join("ref.py"),
    );
    std::fs::write(&inp, serde_json::to_string(&cases).unwrap()).unwrap();
    std::fs::write(&script, REFERENCE).unwrap();
    let py = python();
    let st = Command::new(&py)
        .arg(&script)
        .arg(&inp)
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}; run `just setup-test`", py.display()));
    assert!(st.success(), "the Python reference failed");
    let want: Vec<(String, f64, Vec<String>)> =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let mut mismatches = Vec::new();
    for ((s, g), (norm, f1, spans)) in cases.iter().zip(&want) {
        let got_spans: Vec<String> = answer_spans(s).into_iter().map(String::from).collect();
        if normalize_answer(s) != *norm || (f1_score(s, g) - f1).abs() > 1e-9 || got_spans != *spans
        {
            mismatches.push(format!(
                "{s:?} / {g:?}: rust {:?} python {norm:?}",
                normalize_answer(s)
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} differ, e.g.\n{}",
        mismatches.len(),
        cases.len(),
        mismatches[..mismatches.len().min(10)].join("\n")
    );
}
