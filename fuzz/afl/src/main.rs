//! `switchyard-afl TARGET`: runs one fuzz target under AFL++ (persistent
//! mode); the targets are `fuzz_targets::TARGETS`.

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(target) = fuzz_targets::target(&name) else {
        let names: Vec<&str> = fuzz_targets::TARGETS.iter().map(|t| t.name).collect();
        eprintln!("usage: switchyard-afl TARGET, one of: {}", names.join(", "));
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| (target.run)(data));
}
