//! Crash points: named moments where a test may make the process die, to prove that
//! recovery from a crash at exactly that moment holds.
//!
//! `GANTRY_CRASH_AT=<name>` in the environment makes the process exit at once, with
//! [`CRASH_EXIT_CODE`], the first time it reaches [`point`]`("<name>")`. No destructor
//! runs and no other thread finishes its work, so what is on disk is what a SIGKILL
//! there would leave (`abort` would do the same but may write a core file). The switch
//! exists only in builds with debug assertions, which is what the tests run; a release
//! binary ignores the variable, so no deployment can be crashed through it.

/// The environment variable that names the crash point to fire.
pub const CRASH_AT_ENV: &str = "GANTRY_CRASH_AT";

/// The exit status of a process stopped at a crash point.
pub const CRASH_EXIT_CODE: i32 = 86;

/// Ends the process here when `GANTRY_CRASH_AT` names this point (debug builds only).
#[inline]
pub fn point(name: &str) {
    #[cfg(debug_assertions)]
    if std::env::var_os(CRASH_AT_ENV).is_some_and(|v| v == name) {
        eprintln!("gantry: crash point {name} reached ({CRASH_AT_ENV}); exiting with {CRASH_EXIT_CODE}");
        std::process::exit(CRASH_EXIT_CODE);
    }
    #[cfg(not(debug_assertions))]
    let _ = name;
}
