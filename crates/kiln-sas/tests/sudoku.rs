//! Integration tests of the Sudoku core: generator, solver, expert order, loaders, tokens.

use std::path::{Path, PathBuf};

use kiln_sas::sudoku::tokens::{
    TauError, decode, encode, givens_mask, kendall_tau, kendall_tau_b, vocab_size,
};
use kiln_sas::sudoku::{
    Board, BoardError, Difficulty, Format, GenParams, GenerateError, LineError, LoadError,
    LoadOptions, Puzzle, Shape, Technique, UnitKind, cache_path, expert_order, generate,
    generate_one, load_file, load_or_generate_in, load_puzzles, parse_text, solve, write_jsonl,
};
use proptest::prelude::*;

fn shared(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/datasets/sudoku")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: the shared datasets must sit next to the repository (<repo>/../shared/datasets)",
        p.display()
    );
    p
}

/// Independent reference counter: plain backtracking without propagation, counting up to 2.
fn naive_count(cells: &mut [u8], shape: Shape, limit: usize) -> usize {
    let side = shape.side();
    let bs = shape.box_size();
    let Some(i) = cells.iter().position(|&v| v == 0) else {
        return 1;
    };
    let (r, c) = (i / side, i % side);
    let mut total = 0;
    for d in 1..=side as u8 {
        let clash = (0..side).any(|k| {
            cells[r * side + k] == d
                || cells[k * side + c] == d
                || cells[((r / bs) * bs + k / bs) * side + (c / bs) * bs + k % bs] == d
        });
        if !clash {
            cells[i] = d;
            total += naive_count(cells, shape, limit - total);
            cells[i] = 0;
            if total >= limit {
                break;
            }
        }
    }
    total
}

fn check_expert_order(p: &Puzzle) {
    let o = expert_order(&p.puzzle, &p.solution).unwrap();
    let mut cells = o.cells();
    cells.sort_unstable();
    assert_eq!(
        cells,
        p.puzzle.blanks(),
        "order must cover exactly the blanks"
    );
    let mut board = p.puzzle.cells().to_vec();
    let mut last_round = 0;
    for f in &o.fills {
        assert_eq!(f.value, p.solution.get(f.cell));
        assert!(f.round >= last_round);
        last_round = f.round;
        // Each fill is legal on the board as it stands.
        let b = Board::from_cells(p.puzzle.shape(), board.clone()).unwrap();
        assert!(b.can_place(f.cell, f.value), "illegal fill {f:?}");
        board[f.cell] = f.value;
    }
    assert_eq!(board, p.solution.cells());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn generated_9x9_puzzles_have_exactly_one_solution(seed in any::<u64>(), index in 0usize..1000, givens in 24usize..40) {
        let params = GenParams::new(1, givens, seed);
        let p = generate_one(&params, index).unwrap();
        prop_assert_eq!(p.n_givens(), givens);
        prop_assert!(p.unique);
        prop_assert!(p.puzzle.is_solved_by(&p.solution));
        prop_assert_eq!(solve(&p.puzzle).count, 1);
        let mut cells = p.puzzle.cells().to_vec();
        prop_assert_eq!(naive_count(&mut cells, Shape::NINE, 2), 1);
        check_expert_order(&p);
    }

    #[test]
    fn generated_4x4_puzzles_have_exactly_one_solution(seed in any::<u64>(), givens in 4usize..10) {
        let params = GenParams { shape: Shape::FOUR, ..GenParams::new(1, givens, seed) };
        let p = generate_one(&params, 0).unwrap();
        prop_assert_eq!(p.puzzle.shape(), Shape::FOUR);
        prop_assert_eq!(p.n_givens(), givens);
        let mut cells = p.puzzle.cells().to_vec();
        prop_assert_eq!(naive_count(&mut cells, Shape::FOUR, 2), 1);
        check_expert_order(&p);
    }

    #[test]
    fn token_roundtrip(seed in any::<u64>()) {
        let p = generate_one(&GenParams::new(1, 30, seed), 0).unwrap();
        let t = encode(&p.puzzle);
        prop_assert_eq!(t.len(), 81);
        prop_assert!(t.iter().all(|&x| (x as usize) < vocab_size(Shape::NINE)));
        prop_assert_eq!(decode(&t, Shape::NINE).unwrap(), p.puzzle.clone());
        let g = givens_mask(&p.puzzle);
        prop_assert_eq!(g.iter().filter(|&&x| x).count(), 30);
        prop_assert!(g.iter().zip(&t).all(|(&given, &tok)| given == (tok != 0)));
    }
}

#[test]
fn solver_agrees_with_all_magictour_solutions() {
    let path = shared("magictour_top1465.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut n = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let puzzle = Board::parse(v["puzzle"].as_str().unwrap()).unwrap();
        let s = solve(&puzzle);
        assert_eq!(s.count, 1, "{puzzle} should be unique");
        assert_eq!(
            s.board.unwrap().to_string(),
            v["solution"].as_str().unwrap(),
            "{puzzle}"
        );
        n += 1;
    }
    assert_eq!(n, 1465);
}

#[test]
fn expert_order_on_magictour_and_4x4() {
    let hard = load_puzzles(shared("magictour_top1465.jsonl")).unwrap();
    assert_eq!(hard.len(), 1465);
    let mut needs_search = 0;
    for p in &hard {
        check_expert_order(p);
        let o = expert_order(&p.puzzle, &p.solution).unwrap();
        needs_search += usize::from(o.difficulty() == Difficulty::Search);
        if o.difficulty() == Difficulty::Search {
            assert!(o.count(Technique::Search) > 0);
        }
    }
    // The hardest known puzzles: nearly all need search beyond singles.
    assert!(needs_search > 1400, "{needs_search}");
    let small = load_puzzles(shared("sudoku4x4_test.csv")).unwrap();
    for p in &small {
        check_expert_order(p);
    }
}

#[test]
fn loaders_read_all_shared_files() {
    let hard = load_puzzles(shared("magictour_top1465.jsonl")).unwrap();
    assert_eq!(hard.len(), 1465);
    assert!(
        hard.iter()
            .all(|p| p.unique && p.puzzle.shape() == Shape::NINE)
    );
    assert_eq!(hard[0].n_givens(), 18);

    let small = load_puzzles(shared("sudoku4x4_test.csv")).unwrap();
    assert_eq!(small.len(), 500);
    assert!(small.iter().all(|p| p.puzzle.shape() == Shape::FOUR));
    assert_eq!(small[0].puzzle.to_line('0'), "3102200002100320");
    assert_eq!(small[0].solution.to_line('0'), "3142243142131324");

    // 81-char lines with '.' and with '0' blanks, written from the magictour puzzles.
    let dir = tempfile::tempdir().unwrap();
    for blank in ['.', '0'] {
        let path = dir.path().join(format!("lines{}.txt", blank as u32));
        let text: String = hard
            .iter()
            .take(200)
            .map(|p| p.puzzle.to_line(blank) + "\n")
            .collect();
        std::fs::write(&path, format!("# comment\n\n{text}")).unwrap();
        let loaded = load_puzzles(&path).unwrap();
        assert_eq!(loaded.len(), 200);
        for (a, b) in loaded.iter().zip(&hard) {
            assert_eq!(a, b);
        }
    }
    // JSONL written by write_jsonl reads back identically.
    let path = dir.path().join("out.jsonl");
    write_jsonl(&path, &small).unwrap();
    assert_eq!(load_puzzles(&path).unwrap(), small);
}

const P: &str = "4...3.......6..8..........1....5..9..8....6...7.2........1.27..5.3....4.9........";
const S: &str = "468931527751624839392578461134756298289413675675289314846192753513867942927345186";

#[test]
fn bad_inputs_give_the_right_error() {
    let short = &P[..80];
    let illegal = P.replacen('.', "x", 1);
    let contradiction = P.replacen('.', "4", 1); // a second 4 in row 1
    // Consistent givens without a solution: r1c9 has no candidate left.
    let unsolvable = format!("12345678.........9{}", ".".repeat(63));
    let wrong_solution = S.replacen('4', "1", 1);
    let mismatched = {
        let mut s: Vec<char> = S.chars().collect();
        s.swap(1, 2); // still a digit string but wrong for the given 4..
        s.into_iter().collect::<String>()
    };
    type Check = fn(&LineError) -> bool;
    let cases: Vec<(Format, String, usize, Check)> = vec![
        (Format::Lines, format!("{P}\n{short}\n"), 2, |e| {
            matches!(
                e,
                LineError::Puzzle(BoardError::WrongLength { found: 80, .. })
            )
        }),
        (Format::Lines, format!("{P}\n\n{illegal}\n"), 3, |e| {
            matches!(
                e,
                LineError::Puzzle(BoardError::IllegalChar {
                    ch: 'x',
                    position: 2,
                    ..
                })
            )
        }),
        (Format::Lines, format!("{contradiction}\n"), 1, |e| {
            matches!(
                e,
                LineError::Puzzle(BoardError::Contradiction {
                    digit: 4,
                    unit: UnitKind::Row,
                    unit_number: 1,
                    ..
                })
            )
        }),
        (Format::Lines, format!("{P}\n{unsolvable}\n"), 2, |e| {
            matches!(e, LineError::NoSolution)
        }),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{unsolvable}\"}}\n"),
            1,
            |e| matches!(e, LineError::NoSolution),
        ),
        (Format::Jsonl, "{\"puzzle\": 5}\n".to_string(), 1, |e| {
            matches!(e, LineError::Json(_))
        }),
        (Format::Jsonl, "not json\n".to_string(), 1, |e| {
            matches!(e, LineError::Json(_))
        }),
        (
            Format::Jsonl,
            format!("{{\"solution\": \"{S}\"}}\n"),
            1,
            |e| matches!(e, LineError::Json(_)),
        ),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{P}\", \"solution\": \"{}\"}}\n", &S[..80]),
            1,
            |e| matches!(e, LineError::Solution(BoardError::WrongLength { .. })),
        ),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{P}\", \"solution\": \"{wrong_solution}\"}}\n"),
            1,
            |e| matches!(e, LineError::Solution(BoardError::Contradiction { .. })),
        ),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{P}\", \"solution\": \"{mismatched}\"}}\n"),
            1,
            |e| matches!(e, LineError::Solution(_) | LineError::SolutionMismatch),
        ),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{P}\", \"solution\": \"{P}\"}}\n"),
            1,
            |e| matches!(e, LineError::SolutionMismatch),
        ),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{P}\", \"n_givens\": 17}}\n"),
            1,
            |e| {
                matches!(
                    e,
                    LineError::NGivensMismatch {
                        stated: 17,
                        actual: 18
                    }
                )
            },
        ),
        (
            Format::Jsonl,
            format!("{{\"puzzle\": \"{}\", \"unique\": true}}\n", ".".repeat(81)),
            1,
            |e| {
                matches!(
                    e,
                    LineError::UniqueMismatch {
                        stated: true,
                        actual: false
                    }
                )
            },
        ),
        (
            Format::Csv,
            "Puzzle,Solution\n3102200002100320,3142243142131324\n31022000021003,3142243142131324\n"
                .to_string(),
            3,
            |e| {
                matches!(
                    e,
                    LineError::Puzzle(BoardError::WrongLength { found: 14, .. })
                )
            },
        ),
        (
            Format::Csv,
            "Puzzle,Solution\n3102200002100320,3142243142131324,1\n".to_string(),
            2,
            |e| matches!(e, LineError::CsvFields(3)),
        ),
        (
            Format::Csv,
            "Puzzle,Solution\n3102200002100520,3142243142131324\n".to_string(),
            2,
            |e| {
                matches!(
                    e,
                    LineError::Puzzle(BoardError::IllegalChar { ch: '5', .. })
                )
            },
        ),
        (
            Format::Csv,
            "Puzzle,Solution\n3102200002100320,3142243142131342\n".to_string(),
            2,
            |e| matches!(e, LineError::Solution(BoardError::Contradiction { .. })),
        ),
    ];
    let path = Path::new("data/bad.txt");
    for (i, (format, text, line, check)) in cases.iter().enumerate() {
        match parse_text(text, path, *format, false) {
            Err(LoadError::Line {
                path: p,
                line: l,
                kind,
            }) => {
                assert_eq!(p, path);
                assert_eq!(l, *line, "case {i}: {kind}");
                assert!(check(&kind), "case {i}: unexpected error {kind:?}");
                let msg = LoadError::Line {
                    path: p,
                    line: l,
                    kind,
                }
                .to_string();
                assert!(msg.starts_with(&format!("data/bad.txt:{line}: ")), "{msg}");
            }
            other => panic!("case {i}: expected a line error, got {other:?}"),
        }
    }
}

#[test]
fn lenient_mode_skips_and_counts() {
    let text = format!("{P}\n{}\nxyz\n{P}\n", &P[..70]);
    let loaded = parse_text(&text, Path::new("x.txt"), Format::Lines, true).unwrap();
    assert_eq!(loaded.puzzles.len(), 2);
    assert_eq!(loaded.skipped.len(), 2);
    assert!(matches!(loaded.skipped[1], LoadError::Line { line: 3, .. }));
    // All lines bad: an Empty error that reports the skip count.
    assert!(matches!(
        parse_text("xyz\n", Path::new("x.txt"), Format::Lines, true),
        Err(LoadError::Empty { skipped: 1, .. })
    ));
    assert!(matches!(
        parse_text("", Path::new("x.txt"), Format::Lines, false),
        Err(LoadError::Empty { skipped: 0, .. })
    ));
    // A missing file is an Io error naming the file.
    let e = load_file("/nonexistent/s.jsonl", LoadOptions::lenient()).unwrap_err();
    assert!(matches!(e, LoadError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/s.jsonl"));
}

#[test]
fn generation_is_deterministic_and_thread_independent() {
    let params = GenParams::new(24, 28, 99);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| generate(&params).unwrap());
    let two = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
        .install(|| generate(&params).unwrap());
    assert_eq!(one, two);
    let prefix = generate(&GenParams::new(10, 28, 99)).unwrap();
    assert_eq!(&one[..10], &prefix[..]);
    let other_seed = generate(&GenParams::new(10, 28, 100)).unwrap();
    assert_ne!(prefix, other_seed);
    // All puzzles distinct.
    let mut s: Vec<String> = one.iter().map(|p| p.puzzle.to_string()).collect();
    s.sort();
    s.dedup();
    assert_eq!(s.len(), one.len());
}

#[test]
fn difficulty_constraints_are_met() {
    let singles = GenParams {
        max_difficulty: Difficulty::HiddenSingles,
        ..GenParams::new(20, 28, 5)
    };
    for p in generate(&singles).unwrap() {
        let o = expert_order(&p.puzzle, &p.solution).unwrap();
        assert!(o.difficulty() <= Difficulty::HiddenSingles);
        assert_eq!(o.count(Technique::Search), 0);
        assert_eq!(p.n_givens(), 28);
    }
    let naked = GenParams {
        max_difficulty: Difficulty::NakedSingles,
        ..GenParams::new(10, 32, 5)
    };
    for p in generate(&naked).unwrap() {
        let o = expert_order(&p.puzzle, &p.solution).unwrap();
        assert_eq!(o.count(Technique::NakedSingle), 81 - 32);
    }
    let search = GenParams {
        min_difficulty: Difficulty::Search,
        ..GenParams::new(20, 26, 5)
    };
    for p in generate(&search).unwrap() {
        let o = expert_order(&p.puzzle, &p.solution).unwrap();
        assert_eq!(o.difficulty(), Difficulty::Search);
        assert_eq!(solve(&p.puzzle).count, 1);
    }
    // Impossible targets fail with a clear error instead of looping.
    let impossible = GenParams {
        max_attempts: 3,
        ..GenParams::new(1, 10, 5)
    };
    let e = generate(&impossible).unwrap_err();
    assert!(
        matches!(e, GenerateError::Unreachable { index: 0, .. }),
        "{e}"
    );
}

#[test]
fn load_or_generate_caches() {
    let dir = tempfile::tempdir().unwrap();
    let params = GenParams::new(30, 30, 3);
    let path = cache_path(&params, dir.path());
    assert_eq!(
        path.file_name().unwrap().to_str().unwrap(),
        format!("{}.jsonl", params.cache_key())
    );
    let first = load_or_generate_in(&params, dir.path()).unwrap();
    assert!(path.exists());
    assert!(
        dir.path()
            .join(format!("{}.params.json", params.cache_key()))
            .exists()
    );
    // The cached file is in the magictour layout.
    let line = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["n_givens"], 30);
    assert_eq!(v["unique"], true);
    assert_eq!(v["puzzle"].as_str().unwrap().len(), 81);
    assert_eq!(v["solution"].as_str().unwrap().len(), 81);
    // A second call reads the cache (same result) ...
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    assert_eq!(load_or_generate_in(&params, dir.path()).unwrap(), first);
    assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
    // ... and a corrupted cache is regenerated.
    std::fs::write(&path, "garbage\n").unwrap();
    assert_eq!(load_or_generate_in(&params, dir.path()).unwrap(), first);
    assert_eq!(load_puzzles(&path).unwrap(), first);
}

#[test]
fn kendall_tau_known_cases() {
    let a = [0usize, 1, 2, 3];
    assert_eq!(kendall_tau(&a, &a).unwrap(), 1.0);
    assert_eq!(kendall_tau(&a, &[3, 2, 1, 0]).unwrap(), -1.0);
    // One adjacent swap: 1 discordant pair of 6 -> (5 - 1) / 6.
    assert!((kendall_tau(&a, &[1, 0, 2, 3]).unwrap() - 2.0 / 3.0).abs() < 1e-12);
    // Items need not be 0..n: cell indices of a puzzle's blanks.
    assert!((kendall_tau(&[10, 40, 7], &[40, 10, 7]).unwrap() - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(
        kendall_tau(&a, &[0, 1, 2]),
        Err(TauError::LengthMismatch(4, 3))
    );
    assert!(matches!(
        kendall_tau(&a, &[0, 1, 2, 2]),
        Err(TauError::NotPermutation(_))
    ));
    assert!(matches!(
        kendall_tau(&a, &[0, 1, 2, 9]),
        Err(TauError::NotPermutation(_))
    ));
    assert_eq!(kendall_tau(&[1], &[1]), Err(TauError::TooFew));

    // tau-b equals tau without ties, and handles ties (scipy.stats.kendalltau([1,2,3,4],[1,1,2,3]) = 0.9128709).
    let x = [1.0, 2.0, 3.0, 4.0];
    assert!((kendall_tau_b(&x, &[2.0, 1.0, 3.0, 4.0]).unwrap() - 2.0 / 3.0).abs() < 1e-12);
    assert!(
        (kendall_tau_b(&x, &[1.0, 1.0, 2.0, 3.0]).unwrap() - 0.912_870_929_175_276_8).abs() < 1e-12
    );
    assert_eq!(kendall_tau_b(&x, &[1.0; 4]), None);
    assert_eq!(kendall_tau_b(&x, &[1.0, 2.0]), None);
}
