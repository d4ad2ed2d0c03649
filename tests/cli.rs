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

/// Runs each `(args, message)` case: the command must exit with `status` (1: the library's
/// refusal; 2: a usage error; never 101, a panic) and say `message`.
fn refused(cases: &[(&[&str], &str)], status: i32) {
    for &(args, want) in cases {
        let (code, text) = flashcore(args);
        assert_eq!(code, Some(status), "{args:?}: {text}");
        assert!(text.contains(want), "{args:?}: {text}");
    }
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
    // The library's size checks (or the layout's, behind them) name the address space.
    assert!(text.contains("pass the address space"), "{text}");
}

/// Sizes the library would refuse are refused by every command that sizes buffers from
/// them, with the library's message and before a GPU is opened (so also on a machine
/// without one): they used to be multiplied, drawn and uploaded first.
#[test]
fn commands_check_their_sizes_before_opening_a_gpu() {
    let cases: [(&[&str], &str); 10] = [
        (&["run", "--batch", "0"], "zero-size dimension (batch)"),
        (
            &["run", "--batch", "4000000000", "--seqlen", "4000000000"],
            "pass the address space",
        ),
        (
            &["run", "--head-dim", "12"],
            "unsupported head dimension 12",
        ),
        (
            &["run", "--dtype", "e4m3", "--heads", "5", "--kv-heads", "2"],
            "must be a multiple of key/value heads",
        ),
        (
            &["fp8", "--shapes", "1:1:0:128"],
            "zero-size dimension (seqlen)",
        ),
        // FP8 has head dims 64, 128 and 256 only.
        (
            &["run", "--dtype", "e4m3", "--head-dim", "96"],
            "unsupported head dimension 96",
        ),
        (
            &["fp8", "--shapes", "1:1:128:96"],
            "unsupported head dimension 96",
        ),
        (
            &["decode", "--shapes", "0x100"],
            "zero-size dimension (batch)",
        ),
        (
            &["varlen", "--lens", "5,0,7", "--head-dim", "300"],
            "unsupported head dimension 300",
        ),
        (&["decode", "--shapes", "1x100000000"], "exceeds the limit"),
    ];
    // A run failure with the library's error.
    refused(&cases, 1);
}

/// `varlen --q-lens` must give one query length per key length, each a number.
#[test]
fn varlen_query_lengths_match_the_key_lengths() {
    refused(
        &[
            (
                &["varlen", "--lens", "5,7", "--q-lens", "1"][..],
                "--q-lens has 1 lengths, --lens 2",
            ),
            (
                &["varlen", "--lens", "5,7", "--q-lens", "1,x"][..],
                "bad length `x` in --q-lens",
            ),
        ],
        2,
    );
}

/// `--window LEFT,RIGHT` is read as FlashAttention's window_size: a malformed one is a
/// usage error, a causal one reaching past the diagonal the library's refusal, both before
/// a GPU is opened.
#[test]
fn windows_are_checked_before_opening_a_gpu() {
    for args in [
        &["run", "--window", "3"][..],
        &["run", "--window", "a,0"],
        &["decode", "--window", "4095"],
    ] {
        let (code, text) = flashcore(args);
        assert_ne!(code, Some(0), "{args:?}: {text}");
        assert!(
            text.contains("--window takes LEFT,RIGHT"),
            "{args:?}: {text}"
        );
    }
    let (code, text) = flashcore(&["run", "--causal", "--window", "3,1"]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("the window's right side is 1"), "{text}");
}

#[test]
fn soft_caps_are_checked_before_opening_a_gpu() {
    for args in [&["run", "--softcap", "x"][..], &["decode", "--softcap", ""]] {
        let (code, text) = flashcore(args);
        assert_ne!(code, Some(0), "{args:?}: {text}");
        assert!(
            text.contains("--softcap takes a number"),
            "{args:?}: {text}"
        );
    }
    for cap in ["-1", "inf", "NaN"] {
        let (code, text) = flashcore(&["run", "--softcap", cap]);
        assert_ne!(code, Some(0), "{cap}: {text}");
        assert!(
            text.contains("softcap must be finite and positive"),
            "{cap}: {text}"
        );
    }
    let (code, text) = flashcore(&["run", "--dtype", "e4m3", "--softcap", "30"]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("no soft-capping"), "{text}");
}

/// The FP8 commands check their sizes as the library does (head dims 64, 128 and 256
/// only) before anything is drawn or a GPU opened: `calibrate` used to panic on a head
/// count or head dim of 0 and on head dims without an FP8 kernel, `quantize-bench` to
/// open the GPU first.
#[test]
fn fp8_commands_check_their_sizes_first() {
    refused(
        &[
            (
                &["calibrate", "--cpu", "--heads", "0", "--seqlens", "64"][..],
                "zero-size dimension",
            ),
            (
                &["calibrate", "--cpu", "--head-dim", "0", "--seqlens", "64"][..],
                "zero-size dimension",
            ),
            (
                &["calibrate", "--cpu", "--head-dim", "96", "--seqlens", "64"][..],
                "unsupported head dimension 96",
            ),
            (
                &["calibrate", "--heads", "70000", "--seqlens", "64"][..],
                "exceed the grid limit",
            ),
            (
                &["quantize-bench", "--seqlen", "0"][..],
                "zero-size dimension",
            ),
            (
                &["quantize-bench", "--head-dim", "72"][..],
                "unsupported head dimension 72",
            ),
            (
                &["quantize-bench", "--heads", "3", "--kv-heads", "2"][..],
                "must be a multiple of key/value heads",
            ),
        ],
        1,
    );
}

/// Malformed arguments are usage errors (exit status 2), before a GPU is opened.
#[test]
fn malformed_arguments_are_usage_errors() {
    refused(
        &[
            // An option given last without its value was ignored.
            (
                &["run", "--heads", "8", "--kv-heads"][..],
                "--kv-heads takes a value",
            ),
            // A field that is not a number was dropped, leaving four that were.
            (&["fp8", "--shapes", "1:x:1:128:128"][..], "is not B:H:S:D"),
            (&["fp8", "--shapes", "1:x:128:128"][..], "is not B:H:S:D"),
            (
                &["calibrate", "--cpu", "--seqlens", ","][..],
                "at least one entry",
            ),
            (
                &["calibrate", "--cpu", "--inputs", ","][..],
                "at least one entry",
            ),
            (&["calibrate", "--cpu", "--rows", "0"][..], "--rows"),
            (
                &["calibrate", "--cpu", "--path", "bogus"][..],
                "unknown path `bogus`",
            ),
            (&["run", "--dtype", "E4M3"][..], "lower case"),
        ],
        2,
    );
}
