//! Every file in examples/ must parse and validate, so the documented configs never rot.

use std::path::Path;

#[test]
fn every_example_config_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            gantry_config::Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 2, "expected the example configs in {}", dir.display());
}

#[test]
fn the_full_example_is_exactly_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/gantry.toml");
    let c = gantry_config::Config::load(&path).unwrap();
    let d = gantry_config::Config::default();
    assert_eq!(format!("{c:?}"), format!("{d:?}"), "examples/gantry.toml documents the defaults");
}
