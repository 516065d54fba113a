//! `fuzz-seeds DIR`: writes each fuzz target's seeds to `DIR/<target>/`
//! (the AFL++ input corpus `scripts/fuzz` starts from); `fuzz-seeds --list`
//! prints the targets, one a line, with what each reads.

use std::path::PathBuf;

use fuzz_targets::TARGETS;

fn main() -> std::io::Result<()> {
    let Some(arg) = std::env::args().nth(1) else {
        eprintln!("usage: fuzz-seeds DIR | --list");
        std::process::exit(2);
    };
    if arg == "--list" {
        for t in TARGETS {
            println!("{}\t{}", t.name, t.what);
        }
        return Ok(());
    }
    let dir = PathBuf::from(arg);
    for t in TARGETS {
        let folder = dir.join(t.name);
        std::fs::create_dir_all(&folder)?;
        for (i, seed) in (t.seeds)().iter().enumerate() {
            std::fs::write(folder.join(format!("seed-{i}")), seed)?;
        }
    }
    Ok(())
}
