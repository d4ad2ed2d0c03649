//! The command line on bad arguments, on any machine: errors name the argument and the
//! exit status is nonzero, before a GPU is needed.

use std::process::Command;

/// Runs `flashcore args…`; returns (exit status, stdout + stderr).
fn flashcore(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flashcore"))
        .args(args)
        .output()
        .expect("the flashcore binary runs");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

#[test]
fn unknown_arguments_are_named() {
    let (code, text) = flashcore(&["run", "--bogus"]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("unknown argument `--bogus`"), "{text}");
}

/// Sizes whose FP8 operands pass the address space are refused before anything is
/// allocated (they used to be multiplied unchecked after the GPU was opened).
#[test]
fn quantize_bench_refuses_sizes_past_the_address_space() {
    let (code, text) = flashcore(&[
        "quantize-bench",
        "--batch",
        "4000000000",
        "--seqlen",
        "4000000000",
    ]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("overflow the address space"), "{text}");
}
