//! Answer normalisation, exact match, token F1 and answer extraction, as in SQuAD / Search-R1.
//!
//! [`normalize_answer`] reproduces the SQuAD `normalize_answer` that Search-R1's reward uses, step for step:
//! 1. lowercase (full Unicode lowercasing, like Python's `str.lower`, including the final-sigma rule);
//! 2. remove ASCII punctuation (Python's `string.punctuation`: ``!"#$%&'()*+,-./:;<=>?@[\]^_`{|}~``; Unicode
//!    punctuation such as `“` or `—` is kept, as in Python);
//! 3. replace the words `a`, `an`, `the` by a space (a word is a maximal run of word characters, matching the
//!    regex `\b(a|an|the)\b` on a `str` in Python);
//! 4. collapse whitespace (Python's `" ".join(s.split())`, including the separators U+001C..U+001F that
//!    Python counts as whitespace and Rust does not).
//!
//! The only known divergence from Python: Rust's `char::is_alphanumeric` counts the combining marks of
//! `Other_Alphabetic` (e.g. Devanagari vowel signs) as word characters where Python's `\w` does not, which only
//! matters for an article glued to such a mark (`"thé"` and `"the\u{301}"` agree; circled letters are handled).
//! `tests/normalize_python.rs` compares against the Python reference on 5,000 random strings.
//! The standard library exposes no general category and no maintained small crate is in the workspace, so this
//! is hand-written; the test table was produced by the Python reference.
//!
//! [`extract_answer`] returns the LAST `<answer>...</answer>` span of a response (non-greedy, like Search-R1's
//! `re.finditer(r"<answer>(.*?)</answer>", s, re.DOTALL)`), trimmed. Apply it to the response only, not to the
//! prompt (Search-R1 applies it to prompt + response and therefore needs two matches, because its prompt contains
//! an example answer).

use std::collections::HashMap;

/// ASCII punctuation removed by [`normalize_answer`] (Python's `string.punctuation`).
pub const ASCII_PUNCTUATION: &str = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/// Opening answer tag.
pub const ANSWER_OPEN: &str = "<answer>";
/// Closing answer tag.
pub const ANSWER_CLOSE: &str = "</answer>";

/// Python's `str.isspace` (used by `str.split()`): Rust's `White_Space` plus U+001C..U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `\w` for `str` patterns (approximately: see the module docs). Rust's `Alphabetic` also holds the
/// circled and squared Latin letters (`Other_Alphabetic`, category So), which Python does not count as word
/// characters; they are excluded here.
fn is_word_char(c: char) -> bool {
    const SYMBOL_LETTERS: [std::ops::RangeInclusive<char>; 4] = [
        '\u{24b6}'..='\u{24e9}',
        '\u{1f130}'..='\u{1f149}',
        '\u{1f150}'..='\u{1f169}',
        '\u{1f170}'..='\u{1f189}',
    ];
    c == '_' || (c.is_alphanumeric() && !SYMBOL_LETTERS.iter().any(|r| r.contains(&c)))
}

/// SQuAD / Search-R1 answer normalisation: lowercase, strip ASCII punctuation, drop the articles a/an/the,
/// collapse whitespace.
///
/// ```
/// assert_eq!(kiln_search::answer::normalize_answer("  The Eiffel-Tower! "), "eiffeltower");
/// ```
pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punc: String = lower
        .chars()
        .filter(|c| !(c.is_ascii() && ASCII_PUNCTUATION.contains(*c)))
        .collect();
    // Replace maximal word runs equal to an article by a space.
    let mut no_art = String::with_capacity(no_punc.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in no_punc.chars() {
        if is_word_char(c) {
            word.push(c);
        } else {
            flush(&mut word, &mut no_art);
            no_art.push(c);
        }
    }
    flush(&mut word, &mut no_art);
    let mut out = String::with_capacity(no_art.len());
    for tok in no_art.split(is_py_space).filter(|t| !t.is_empty()) {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(tok);
    }
    out
}

/// Exact match of two strings after [`normalize_answer`].
pub fn exact_match(prediction: &str, gold: &str) -> bool {
    normalize_answer(prediction) == normalize_answer(gold)
}

/// 1.0 if `prediction` exactly matches any gold alias after normalisation, else 0.0 (Search-R1's `em_check`).
/// No aliases gives 0.0.
pub fn em_any<S: AsRef<str>>(prediction: &str, golds: &[S]) -> f64 {
    let p = normalize_answer(prediction);
    if golds.iter().any(|g| normalize_answer(g.as_ref()) == p) {
        1.0
    } else {
        0.0
    }
}

/// SQuAD token F1 between a prediction and one gold answer (bag-of-tokens overlap of the normalised strings;
/// 0 when there is no common token, so two empty strings score 0 as in SQuAD v1.1).
pub fn f1_score(prediction: &str, gold: &str) -> f64 {
    let p = normalize_answer(prediction);
    let g = normalize_answer(gold);
    let pt: Vec<&str> = p.split(' ').filter(|t| !t.is_empty()).collect();
    let gt: Vec<&str> = g.split(' ').filter(|t| !t.is_empty()).collect();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for t in &gt {
        *counts.entry(t).or_default() += 1;
    }
    let mut same = 0usize;
    for t in &pt {
        if let Some(c) = counts.get_mut(t)
            && *c > 0
        {
            *c -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / pt.len() as f64;
    let recall = same as f64 / gt.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Maximum [`f1_score`] over the gold aliases (0.0 without aliases).
pub fn f1_any<S: AsRef<str>>(prediction: &str, golds: &[S]) -> f64 {
    golds
        .iter()
        .map(|g| f1_score(prediction, g.as_ref()))
        .fold(0.0, f64::max)
}

/// All `<answer>...</answer>` spans of `text`, left to right, untrimmed, with non-greedy, non-overlapping
/// matching (`<answer>a<answer>b</answer>` gives `a<answer>b`).
pub fn answer_spans(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(open) = text[pos..].find(ANSWER_OPEN) {
        let start = pos + open + ANSWER_OPEN.len();
        match text[start..].find(ANSWER_CLOSE) {
            Some(close) => {
                out.push(&text[start..start + close]);
                pos = start + close + ANSWER_CLOSE.len();
            }
            None => break,
        }
    }
    out
}

/// The last `<answer>...</answer>` span of a response, trimmed of whitespace; `None` if there is no complete
/// span. An empty span gives `Some("")`.
pub fn extract_answer(response: &str) -> Option<&str> {
    answer_spans(response)
        .last()
        .map(|s| s.trim_matches(is_py_space))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (input, Python SQuAD `normalize_answer(input)`), generated with CPython 3.
    const NORMALIZE_CASES: &[(&str, &str)] = &[
        ("The Eiffel Tower", "eiffel tower"),
        ("  a   cat  ", "cat"),
        ("An apple a day", "apple day"),
        ("the", ""),
        ("Theatre of the Absurd", "theatre of absurd"),
        ("\"Quoted\" answer", "quoted answer"),
        ("'single' quotes", "single quotes"),
        (
            "\u{201c}Curly\u{201d} quotes",
            "\u{201c}curly\u{201d} quotes",
        ),
        ("U.S.A.", "usa"),
        ("Rock-n-roll!", "rocknroll"),
        ("Caf\u{e9} au lait", "caf\u{e9} au lait"),
        ("\u{c9}COLE NORMALE", "\u{e9}cole normale"),
        ("Stra\u{df}e", "stra\u{df}e"),
        (
            "\u{3a3}\u{39f}\u{3a6}\u{39f}\u{3a3}",
            "\u{3c3}\u{3bf}\u{3c6}\u{3bf}\u{3c2}",
        ),
        ("the_the", "thethe"),
        ("th\u{e9}", "th\u{e9}"),
        ("a1 an2 the3", "a1 an2 the3"),
        ("1,000,000", "1000000"),
        ("$3.5 million", "35 million"),
        ("Jonny\" Craig", "jonny craig"),
        ("", ""),
        ("   ", ""),
        ("\u{130}stanbul", "i\u{307}stanbul"),
        ("tab\tand\nnewline", "tab and newline"),
        ("x\u{a0}y", "x y"),
        ("x\u{2003}y", "x y"),
        ("x\u{1c}y", "x y"),
        (
            "Emily Bront\u{eb} \u{2014} the author",
            "emily bront\u{eb} \u{2014} author",
        ),
        ("l'\u{e9}t\u{e9}", "l\u{e9}t\u{e9}"),
        ("A.", ""),
        ("an-the a", "anthe"),
        (
            "\u{65e5}\u{672c} the \u{6771}\u{4eac}",
            "\u{65e5}\u{672c} \u{6771}\u{4eac}",
        ),
        ("\u{fb01}le", "\u{fb01}le"),
        ("\u{bd} a cup", "\u{bd} cup"),
        ("the\u{301} end", "\u{301} end"),
    ];

    #[test]
    fn normalize_matches_python_reference() {
        for (input, want) in NORMALIZE_CASES {
            assert_eq!(normalize_answer(input), *want, "input {input:?}");
        }
    }

    #[test]
    fn f1_matches_python_reference() {
        let cases: &[(&str, &str, f64)] = &[
            ("Paris France", "paris", 2.0 / 3.0),
            ("the cat sat", "cat sat on mat", 2.0 / 3.0),
            ("", "x", 0.0),
            ("a", "the", 0.0),
            ("New York City", "new york", 0.8),
            ("1 1 2", "1 2 2", 2.0 / 3.0),
        ];
        for (p, g, want) in cases {
            assert!((f1_score(p, g) - want).abs() < 1e-12, "{p:?} vs {g:?}");
        }
    }

    #[test]
    fn em_and_f1_take_any_alias() {
        let golds = ["Barack Obama", "Obama"];
        assert_eq!(em_any("obama.", &golds), 1.0);
        assert_eq!(em_any("the Obama", &golds), 1.0);
        assert_eq!(em_any("Michelle Obama", &golds), 0.0);
        assert!((f1_any("Michelle Obama", &golds) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(em_any("x", &[] as &[&str]), 0.0);
        assert_eq!(f1_any("x", &[] as &[&str]), 0.0);
        // An empty prediction never matches a non-empty gold.
        assert_eq!(em_any("", &golds), 0.0);
        // ... but matches a gold that normalises to nothing (as in Search-R1).
        assert_eq!(em_any("", &["The"]), 1.0);
    }

    #[test]
    fn extraction_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("<think>x</think><answer> Paris </answer>", Some("Paris")),
            (
                "<answer>Lyon</answer> then <answer>Paris</answer>",
                Some("Paris"),
            ),
            ("<answer>Paris</answer>", Some("Paris")),
            ("no tags at all", None),
            ("<answer>unterminated", None),
            ("<answer></answer>", Some("")),
            ("<answer>\n  \n</answer>", Some("")),
            ("<answer>a<answer>b</answer></answer>", Some("a<answer>b")),
            (
                "<answer>Paris</answer> trailing text <search>q</search>",
                Some("Paris"),
            ),
            ("<answer>1</answer><answer>2", Some("1")),
            ("</answer><answer>x</answer>", Some("x")),
            ("<ANSWER>upper</ANSWER>", None),
            ("<answer>multi\nline</answer>", Some("multi\nline")),
            ("<answer>caf\u{e9}</answer>", Some("caf\u{e9}")),
        ];
        for (text, want) in cases {
            assert_eq!(extract_answer(text), *want, "text {text:?}");
        }
    }
}
