//! Measures Sudoku generation and solving speed.
//!
//! `cargo run --release -p kiln-sas --example sudoku_stats -- [N] [GIVENS] [SEED]`
//! (defaults: 1000 puzzles, 30 givens, seed 0). Thread count: `RAYON_NUM_THREADS`.
//! Solves `../shared/datasets/sudoku/magictour_top1465.jsonl` when it exists.

use std::path::PathBuf;
use std::time::Instant;

use kiln_sas::sudoku::{
    Difficulty, GenParams, expert_order, generate, load_puzzles, solve, tokens::kendall_tau,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().map_or(Ok(1000), |s| s.parse())?;
    let givens: usize = args.get(1).map_or(Ok(30), |s| s.parse())?;
    let seed: u64 = args.get(2).map_or(Ok(0), |s| s.parse())?;
    println!("rayon threads: {}", rayon::current_num_threads());

    let params = GenParams::new(n, givens, seed);
    let t = Instant::now();
    let puzzles = generate(&params)?;
    let dt = t.elapsed().as_secs_f64();
    println!(
        "generate: {n} puzzles with {givens} givens in {dt:.3}s = {:.0} puzzles/s",
        n as f64 / dt
    );
    let mut by_difficulty = [0usize; 3];
    for p in &puzzles {
        let d = expert_order(&p.puzzle, &p.solution)?.difficulty();
        by_difficulty[d as usize] += 1;
    }
    println!(
        "  difficulty: naked singles {}, hidden singles {}, search {}",
        by_difficulty[0], by_difficulty[1], by_difficulty[2]
    );
    for (name, min, max, g) in [
        (
            "singles-only (hidden_singles max)",
            Difficulty::NakedSingles,
            Difficulty::HiddenSingles,
            givens,
        ),
        (
            "needs-search",
            Difficulty::Search,
            Difficulty::Search,
            givens.min(26),
        ),
    ] {
        let m = (n / 10).max(1);
        let p = GenParams {
            min_difficulty: min,
            max_difficulty: max,
            ..GenParams::new(m, g, seed)
        };
        let t = Instant::now();
        match generate(&p) {
            Ok(_) => {
                let dt = t.elapsed().as_secs_f64();
                println!(
                    "generate {name}, {g} givens: {m} in {dt:.3}s = {:.0} puzzles/s",
                    m as f64 / dt
                )
            }
            Err(e) => println!("generate {name}, {g} givens: {e}"),
        }
    }

    let t = Instant::now();
    let mut unique = 0;
    for p in &puzzles {
        unique += usize::from(solve(&p.puzzle).is_unique());
    }
    let dt = t.elapsed().as_secs_f64();
    println!(
        "solve generated (count to 2, 1 thread): {:.0} puzzles/s ({unique}/{} unique)",
        puzzles.len() as f64 / dt,
        puzzles.len()
    );

    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/datasets/sudoku/magictour_top1465.jsonl");
    if path.exists() {
        let hard = load_puzzles(&path)?;
        let t = Instant::now();
        let mut agree = 0;
        for p in &hard {
            agree += usize::from(solve(&p.puzzle).board.as_ref() == Some(&p.solution));
        }
        let dt = t.elapsed().as_secs_f64();
        println!(
            "solve magictour_top1465 (count to 2, 1 thread): {} puzzles in {dt:.3}s = {:.0} puzzles/s, {agree} agree with the file",
            hard.len(),
            hard.len() as f64 / dt
        );
        let t = Instant::now();
        let mut tau = 0.0;
        for p in &hard {
            let o = expert_order(&p.puzzle, &p.solution)?;
            tau += kendall_tau(&o.cells(), &p.puzzle.blanks())?;
        }
        let dt = t.elapsed().as_secs_f64();
        println!(
            "expert order on magictour: {:.0} puzzles/s; mean Kendall tau vs left-to-right {:.3}",
            hard.len() as f64 / dt,
            tau / hard.len() as f64
        );
    } else {
        println!(
            "({} not found: skipping the magictour timing)",
            path.display()
        );
    }
    Ok(())
}
