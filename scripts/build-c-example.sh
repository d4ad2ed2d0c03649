#!/usr/bin/env bash
# Builds libflashcore (cargo build --release: target/release/libflashcore.so and .a), then
# the C example examples/c/forward.c twice, and runs both:
#
#   target/c-example/forward_dynamic   linked against libflashcore.so (rpath $ORIGIN/../release)
#   target/c-example/forward_static    linked against libflashcore.a (no libflashcore.so needed)
#
# Also checks that include/flashcore.h compiles as strict C99 and as C++, and that the C
# compiler lays its structs out as src/ffi.rs does (the sizes and offsets its tests assert).
# Without a GPU both programs print "no GPU: skipped" and exit 0.
#
# Usage: scripts/build-c-example.sh [--no-run]      (CC=clang etc. to change the compiler)
# On a GPU machine (no cargo needed there), run the two binaries directly; forward_dynamic
# needs target/release/libflashcore.so next to target/c-example/ (or LD_LIBRARY_PATH).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
run=1
for a in "$@"; do
    case $a in
        --no-run) run=0 ;;
        *) echo "usage: $0 [--no-run]" >&2; exit 2 ;;
    esac
done

CC=${CC:-gcc}
CXX=${CXX:-g++}
out=target/c-example
lib=target/release

echo "==> cargo build --release" >&2
cargo build --release

mkdir -p "$out"
cflags=(-std=c11 -O2 -Wall -Wextra -Werror -Iinclude)

echo "==> header checks" >&2
# The header, and FLASHCORE_ATTENTION_OPTIONS_INIT as callers use it, in C99 and C++.
cat >"$out/header_c99.c" <<'EOF'
#include "flashcore.h"
int main(void) {
    FlashcoreAttentionOptions opts = FLASHCORE_ATTENTION_OPTIONS_INIT;
    return opts.struct_size == sizeof(FlashcoreAttentionOptions) && opts.window_left == -1 ? FLASHCORE_SUCCESS : 1;
}
EOF
"$CC" -std=c99 -pedantic -Wall -Wextra -Werror -Iinclude -c "$out/header_c99.c" -o "$out/header_c99.o"
cat >"$out/header_layout.c" <<'EOF'
#include <stddef.h>
#include "flashcore.h"
/* The layouts src/ffi.rs's tests assert for the Rust side. */
_Static_assert(sizeof(FlashcoreTensor) == 80 && _Alignof(FlashcoreTensor) == 8, "FlashcoreTensor");
_Static_assert(offsetof(FlashcoreTensor, dtype) == 8 && offsetof(FlashcoreTensor, shape) == 16 &&
                   offsetof(FlashcoreTensor, strides) == 48,
               "FlashcoreTensor fields");
_Static_assert(sizeof(FlashcoreKvCache) == 192 && _Alignof(FlashcoreKvCache) == 8, "FlashcoreKvCache");
_Static_assert(offsetof(FlashcoreKvCache, v) == 80 && offsetof(FlashcoreKvCache, seqlens) == 160 &&
                   offsetof(FlashcoreKvCache, block_table) == 168 &&
                   offsetof(FlashcoreKvCache, max_pages) == 176 &&
                   offsetof(FlashcoreKvCache, table_stride) == 184,
               "FlashcoreKvCache fields");
_Static_assert(sizeof(FlashcoreKvScales) == 160 && _Alignof(FlashcoreKvScales) == 8 &&
                   offsetof(FlashcoreKvScales, v_scale) == 80,
               "FlashcoreKvScales");
_Static_assert(sizeof(FlashcoreFp8Operands) == 256 && _Alignof(FlashcoreFp8Operands) == 8,
               "FlashcoreFp8Operands");
_Static_assert(offsetof(FlashcoreFp8Operands, k) == 80 && offsetof(FlashcoreFp8Operands, vt) == 160 &&
                   offsetof(FlashcoreFp8Operands, vt_shape) == 168 &&
                   offsetof(FlashcoreFp8Operands, vt_strides) == 200 &&
                   offsetof(FlashcoreFp8Operands, q_scale) == 224 &&
                   offsetof(FlashcoreFp8Operands, lse_shift) == 248,
               "FlashcoreFp8Operands fields");
_Static_assert(sizeof(FlashcoreQuantizeOptions) == 16 && offsetof(FlashcoreQuantizeOptions, hadamard) == 4 &&
                   offsetof(FlashcoreQuantizeOptions, hadamard_seed) == 8,
               "FlashcoreQuantizeOptions");
_Static_assert(sizeof(FlashcoreAttentionOptions) == 32 && _Alignof(FlashcoreAttentionOptions) == 8 &&
                   offsetof(FlashcoreAttentionOptions, struct_size) == 0 &&
                   offsetof(FlashcoreAttentionOptions, softmax_scale) == 4 &&
                   offsetof(FlashcoreAttentionOptions, window_left) == 8 &&
                   offsetof(FlashcoreAttentionOptions, window_right) == 16 &&
                   offsetof(FlashcoreAttentionOptions, causal) == 24 &&
                   offsetof(FlashcoreAttentionOptions, softcap) == 28,
               "FlashcoreAttentionOptions");
static const FlashcoreAttentionOptions no_options = FLASHCORE_ATTENTION_OPTIONS_INIT;
int main(void) { return (int)no_options.causal; }
EOF
"$CC" -std=c11 -pedantic -Wall -Wextra -Werror -Iinclude -c "$out/header_layout.c" -o "$out/header_layout.o"
if command -v "$CXX" >/dev/null; then
    "$CXX" -x c++ -std=c++11 -pedantic -Wall -Wextra -Werror -Iinclude -fsyntax-only "$out/header_c99.c"
else
    echo "    ($CXX not found: C++ check skipped)" >&2
fi

echo "==> $out/forward_dynamic (libflashcore.so)" >&2
"$CC" "${cflags[@]}" examples/c/forward.c -o "$out/forward_dynamic" \
    -L"$lib" -lflashcore -Wl,-rpath,'$ORIGIN/../release' -ldl -lm

echo "==> $out/forward_static (libflashcore.a)" >&2
"$CC" "${cflags[@]}" examples/c/forward.c -o "$out/forward_static" \
    "$lib/libflashcore.a" -lpthread -ldl -lm

if command -v ldd >/dev/null; then
    # Read ldd's whole output before matching: `ldd | grep -q` under pipefail fails at
    # random when grep exits on the first match and ldd dies of SIGPIPE.
    deps_dynamic=$(ldd "$out/forward_dynamic")
    deps_static=$(ldd "$out/forward_static")
    grep -q 'libflashcore\.so' <<<"$deps_dynamic" \
        || { echo "forward_dynamic does not load libflashcore.so:" >&2; echo "$deps_dynamic" >&2; exit 1; }
    if grep -q 'libflashcore\.so' <<<"$deps_static"; then
        echo "forward_static depends on libflashcore.so" >&2
        exit 1
    fi
fi

if ((run)); then
    for exe in forward_dynamic forward_static; do
        echo "==> $out/$exe" >&2
        "$out/$exe"
    done
fi
echo "==> ok" >&2
