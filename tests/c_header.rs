//! `include/flashcore.h` against `src/ffi.rs` (and the ctypes bindings of the Python
//! package, `python/flashcore/_capi.py`): the same constants with the same values, the same functions with
//! the same parameter types, the same fields of each struct (`FlashcoreTensor`,
//! `FlashcoreKvCache`, `FlashcoreKvScales`, `FlashcoreVarlen`, `FlashcoreFp8Operands`,
//! `FlashcoreQuantizeOptions`, `FlashcoreAttentionOptions`), and the same struct layouts (the C layout the header's fields give
//! against Rust's offsets, sizes and alignments), and `FLASHCORE_ATTENTION_OPTIONS_INIT`
//! against `FlashcoreAttentionOptions::new()`. Plain text parsing: the header is kept
//! in a simple, regular style for it. The three files are embedded in the test binary,
//! which therefore runs anywhere.

use std::collections::BTreeMap;

use std::mem::{align_of, offset_of, size_of};

use flashcore::error::RETURN_CODES;
use flashcore::ffi::{
    FLASHCORE_CONSTANTS, FlashcoreAttentionOptions, FlashcoreFp8Operands, FlashcoreKvCache,
    FlashcoreKvScales, FlashcoreQuantizeOptions, FlashcoreTensor, FlashcoreVarlen,
};

/// The structs of the C ABI, in the order the header defines them.
const STRUCTS: [&str; 7] = [
    "FlashcoreTensor",
    "FlashcoreKvCache",
    "FlashcoreKvScales",
    "FlashcoreVarlen",
    "FlashcoreFp8Operands",
    "FlashcoreQuantizeOptions",
    "FlashcoreAttentionOptions",
];

/// The files the checks read, embedded at compile time: the test binary needs no source
/// tree at run time (the GPU bundle runs it on another machine), and cargo rebuilds it
/// when one of them changes.
const HEADER: &str = include_str!("../include/flashcore.h");
const FFI_RS: &str = include_str!("../src/ffi.rs");
const CAPI_PY: &str = include_str!("../python/flashcore/_capi.py");

fn read(rel: &str) -> String {
    match rel {
        "include/flashcore.h" => HEADER,
        "src/ffi.rs" => FFI_RS,
        "python/flashcore/_capi.py" => CAPI_PY,
        other => panic!("{other} is not embedded in this test; add an include_str! for it"),
    }
    .to_string()
}

/// Removes `/* */` and `//` comments (the header has no string literals containing them).
fn strip_c_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b + 2..].find("*/").expect("unterminated comment") + b + 4;
                out.push(' ');
                rest = &rest[end..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = &rest[l..];
                rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// Collapses whitespace and glues `*` to what precedes it: `const char *` -> `const char*`.
fn norm_c_type(t: &str) -> String {
    let t = t.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut t = t.replace(" *", "*").replace("* ", "*");
    while t.contains(" *") {
        t = t.replace(" *", "*");
    }
    t.trim().to_string()
}

/// Splits `type name` (name = trailing identifier): `const FlashcoreTensor *q` ->
/// (`const FlashcoreTensor*`, `q`).
fn split_c_decl(decl: &str) -> (String, String) {
    let decl = decl.trim();
    let start = decl
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    (norm_c_type(&decl[..start]), decl[start..].to_string())
}

/// A function signature: return type and (type, name) of each parameter, in C spelling.
type Signature = (String, Vec<(String, String)>);

/// A struct's fields: (C type, with `[N]` for arrays; name), in order.
type Fields = Vec<(String, String)>;

struct Header {
    defines: BTreeMap<String, Option<i64>>,
    /// Each `#define NAME {a, b, ...}` (a struct initializer): its elements, trimmed.
    initializers: BTreeMap<String, Vec<String>>,
    functions: BTreeMap<String, Signature>,
    typedefs: Vec<String>,
    /// Each `typedef struct Name { ... } Name;`'s fields, in the order defined.
    structs: Vec<(String, Fields)>,
}

fn parse_header() -> Header {
    let raw = read("include/flashcore.h");
    let text = strip_c_comments(&raw);
    let mut defines = BTreeMap::new();
    let mut initializers = BTreeMap::new();
    let mut body = String::new();
    for line in text.lines() {
        let l = line.trim();
        if let Some(def) = l.strip_prefix("#define") {
            let mut parts = def.split_whitespace();
            let name = parts.next().expect("#define without a name").to_string();
            let value = def.trim_start()[name.len()..].trim();
            if let Some(inside) = value.strip_prefix('{') {
                let inside = inside
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("#define {name}: initializer without a }}"));
                let elements = inside.split(',').map(|e| e.trim().to_string()).collect();
                assert!(
                    !defines.contains_key(&name)
                        && initializers.insert(name.clone(), elements).is_none(),
                    "{name} defined twice"
                );
                continue;
            }
            let value = parts.next().map(|v| {
                v.parse::<i64>()
                    .unwrap_or_else(|_| panic!("#define {name}: value {v:?} is not an integer"))
            });
            assert!(
                parts.next().is_none(),
                "#define {name}: more than one token"
            );
            assert!(
                defines.insert(name.clone(), value).is_none(),
                "{name} defined twice"
            );
        } else if l.starts_with('#') || l == "extern \"C\" {" || l == "}" {
            continue;
        } else {
            body.push_str(l);
            body.push('\n');
        }
    }

    let mut functions = BTreeMap::new();
    let mut typedefs = Vec::new();
    let mut structs = Vec::new();
    let mut rest = body.as_str();
    while let Some(semi) = rest.find(';') {
        let mut stmt = rest[..semi].trim().to_string();
        rest = &rest[semi + 1..];
        if stmt.is_empty() {
            continue;
        }
        if stmt.starts_with("typedef struct") && stmt.contains('{') {
            // A struct definition runs to the `}`; its fields are separate statements.
            let open = stmt.find('{').unwrap();
            let name = stmt["typedef struct".len()..open].trim().to_string();
            assert!(
                STRUCTS.contains(&name.as_str()),
                "unexpected struct: {stmt}"
            );
            let close = rest.find('}').expect("unterminated struct");
            let inside = format!("{};{}", &stmt[open + 1..], &rest[..close]);
            let mut fields = Vec::new();
            for field in inside.split(';').map(str::trim).filter(|f| !f.is_empty()) {
                let (decl, array) = match field.find('[') {
                    Some(i) => (&field[..i], field[i..].replace(' ', "")),
                    None => (field, String::new()),
                };
                let (ty, field_name) = split_c_decl(decl);
                fields.push((format!("{ty}{array}"), field_name));
            }
            let tail_end = rest[close..].find(';').expect("struct without ;") + close;
            assert_eq!(
                rest[close + 1..tail_end].trim(),
                name,
                "typedef name of {name}"
            );
            typedefs.push(name.clone());
            structs.push((name, fields));
            rest = &rest[tail_end + 1..];
            continue;
        }
        stmt = stmt.split_whitespace().collect::<Vec<_>>().join(" ");
        if let Some(td) = stmt.strip_prefix("typedef ") {
            let (ty, name) = split_c_decl(td);
            typedefs.push(format!("{ty} {name}"));
            continue;
        }
        let open = stmt
            .find('(')
            .unwrap_or_else(|| panic!("not a prototype: {stmt}"));
        assert!(stmt.ends_with(')'), "not a prototype: {stmt}");
        let (ret, name) = split_c_decl(&stmt[..open]);
        let params_text = &stmt[open + 1..stmt.len() - 1];
        let params = if params_text.trim() == "void" {
            Vec::new()
        } else {
            params_text.split(',').map(split_c_decl).collect()
        };
        assert!(
            functions.insert(name.clone(), (ret, params)).is_none(),
            "{name} declared twice"
        );
    }
    Header {
        defines,
        initializers,
        functions,
        typedefs,
        structs,
    }
}

impl Header {
    fn fields(&self, name: &str) -> &Fields {
        &self
            .structs
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no struct {name} in the header"))
            .1
    }
}

/// Rust FFI types in C spelling.
fn rust_to_c(t: &str) -> String {
    let t = t.trim();
    if let Some(inner) = t.strip_prefix("*const ") {
        let inner = rust_to_c(inner);
        return if inner.ends_with('*') {
            format!("{inner}const*")
        } else {
            format!("const {inner}*")
        };
    }
    if let Some(inner) = t.strip_prefix("*mut ") {
        return format!("{}*", rust_to_c(inner));
    }
    if let Some(inner) = t.strip_prefix('[') {
        let (elem, n) = inner
            .strip_suffix(']')
            .and_then(|s| s.split_once(';'))
            .unwrap_or_else(|| panic!("bad array type {t}"));
        return format!("{}[{}]", rust_to_c(elem), n.trim());
    }
    match t {
        "" => "void",
        "i32" => "int32_t",
        "u32" => "uint32_t",
        "i64" => "int64_t",
        "u64" => "uint64_t",
        "usize" => "size_t",
        "f32" => "float",
        "c_char" => "char",
        "CUstream" => "flashcore_stream",
        "FlashcoreContext"
        | "FlashcoreTensor"
        | "FlashcoreKvCache"
        | "FlashcoreKvScales"
        | "FlashcoreVarlen"
        | "FlashcoreFp8Operands"
        | "FlashcoreQuantizeOptions"
        | "FlashcoreAttentionOptions" => t,
        other => panic!("no C spelling for Rust type {other}"),
    }
    .to_string()
}

/// The `fn flashcore_*` items of src/ffi.rs, in C spelling; each must be a
/// `#[unsafe(no_mangle)]` `extern "C"` function.
fn parse_rust_functions(src: &str) -> BTreeMap<String, Signature> {
    let mut out = BTreeMap::new();
    let mut from = 0;
    while let Some(pos) = src[from..].find("fn flashcore_") {
        let at = from + pos;
        let line_start = src[..at].rfind('\n').map_or(0, |i| i + 1);
        let line = &src[line_start..at];
        assert!(
            line.trim_end().ends_with("extern \"C\""),
            "fn at byte {at} is not extern \"C\": {line}"
        );
        // The attribute sits on one of the preceding lines, before the item.
        let before = &src[src[..line_start.saturating_sub(1)]
            .rfind("\n\n")
            .unwrap_or(0)..line_start];
        assert!(
            before.contains("#[unsafe(no_mangle)]"),
            "missing #[unsafe(no_mangle)] before {}",
            &src[at..at + 40]
        );
        let open = src[at..].find('(').unwrap() + at;
        let name = src[at + 3..open].trim().to_string();
        // Matching parenthesis of the parameter list.
        let mut depth = 0;
        let mut close = open;
        for (i, c) in src[open..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let brace = src[close..].find('{').unwrap() + close;
        let ret = src[close + 1..brace]
            .trim()
            .strip_prefix("->")
            .unwrap_or("")
            .trim();
        let params = src[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (n, t) = p
                    .split_once(':')
                    .unwrap_or_else(|| panic!("bad parameter {p}"));
                (rust_to_c(t), n.trim().to_string())
            })
            .collect();
        assert!(
            out.insert(name.clone(), (rust_to_c(ret), params)).is_none(),
            "{name} twice"
        );
        from = brace;
    }
    out
}

/// The fields of `pub struct {name}` in src/ffi.rs, in C spelling.
fn parse_rust_fields(src: &str, name: &str) -> Fields {
    let start = src
        .find(&format!("pub struct {name} {{"))
        .unwrap_or_else(|| panic!("no {name} in src/ffi.rs"));
    let body = &src[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
    body.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .map(|l| {
            let l = l.strip_prefix("pub ").unwrap_or(l).trim_end_matches(',');
            let (n, t) = l.split_once(':').expect("field without type");
            (rust_to_c(t), n.trim().to_string())
        })
        .collect()
}

#[test]
fn constants_match() {
    let header = parse_header();
    let mut defined: BTreeMap<String, i64> = BTreeMap::new();
    for (name, value) in &header.defines {
        assert!(name.starts_with("FLASHCORE_"), "stray #define {name}");
        match value {
            Some(v) => {
                defined.insert(name.clone(), *v);
            }
            None => assert_eq!(name, "FLASHCORE_H", "#define {name} without a value"),
        }
    }
    let rust: BTreeMap<String, i64> = FLASHCORE_CONSTANTS
        .iter()
        .map(|&(n, v)| (n.to_string(), i64::from(v)))
        .collect();
    assert_eq!(defined, rust, "header #defines vs ffi::FLASHCORE_CONSTANTS");

    // The table lists every `pub const FLASHCORE_*` of ffi.rs (the dtypes) and every
    // return code of the one table in src/error.rs, and no other name.
    let src = read("src/ffi.rs");
    let mut consts: Vec<String> = src
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const FLASHCORE_"))
        .filter_map(|l| l.split_once(':'))
        .filter(|(_, ty)| ty.trim_start().starts_with("i32"))
        .map(|(n, _)| format!("FLASHCORE_{n}"))
        .chain(RETURN_CODES.iter().map(|r| r.name.to_string()))
        .collect();
    consts.sort();
    let table: Vec<String> = rust.keys().cloned().collect();
    assert_eq!(consts, table, "pub consts vs FLASHCORE_CONSTANTS");
}

/// The header's return-code `#define`s, one per line as `#define NAME VALUE /* summary */`,
/// are exactly `flashcore::error::RETURN_CODES`, in its order: values, names and comments.
#[test]
fn return_codes_match_the_table() {
    let got = return_code_lines(&read("include/flashcore.h"));
    let want: Vec<(String, i64, String)> = RETURN_CODES
        .iter()
        .map(|r| (r.name.to_string(), i64::from(r.code), r.summary.to_string()))
        .collect();
    if got != want {
        let width = RETURN_CODES.iter().map(|r| r.name.len()).max().unwrap_or(0);
        let block: Vec<String> = RETURN_CODES
            .iter()
            .map(|r| {
                let head = format!("#define {} {}", r.name, r.code);
                format!("{head:<w$} /* {} */", r.summary, w = width + 10)
            })
            .collect();
        panic!(
            "include/flashcore.h's return codes differ from src/error.rs's RETURN_CODES.\n\
             header: {got:?}\ntable:  {want:?}\nThe header's block should read:\n{}",
            block.join("\n")
        );
    }
}

/// `(name, value, comment)` of every `#define FLASHCORE_SUCCESS` / `FLASHCORE_ERROR_*` line.
fn return_code_lines(header: &str) -> Vec<(String, i64, String)> {
    header
        .lines()
        .filter_map(|l| l.trim().strip_prefix("#define "))
        .filter(|l| l.starts_with("FLASHCORE_SUCCESS ") || l.starts_with("FLASHCORE_ERROR_"))
        .map(|l| {
            let (def, comment) = l.split_once("/*").unwrap_or((l, ""));
            let mut parts = def.split_whitespace();
            let name = parts.next().unwrap_or_default().to_string();
            let value = parts
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("#define {name}: no integer value"));
            let comment = comment.trim().trim_end_matches("*/").trim().to_string();
            (name, value, comment)
        })
        .collect()
}

#[test]
fn functions_match() {
    let header = parse_header();
    let rust = parse_rust_functions(&read("src/ffi.rs"));
    // Every entry point, by name: one missing from both files is caught here.
    let mut want = [
        "flashcore_create",
        "flashcore_destroy",
        "flashcore_forward",
        "flashcore_check_forward",
        "flashcore_forward_window",
        "flashcore_check_forward_window",
        "flashcore_forward_ex",
        "flashcore_check_forward_ex",
        "flashcore_forward_varlen",
        "flashcore_check_forward_varlen",
        "flashcore_forward_varlen_window",
        "flashcore_check_forward_varlen_window",
        "flashcore_forward_varlen_ex",
        "flashcore_check_forward_varlen_ex",
        "flashcore_decode",
        "flashcore_decode_workspace_bytes",
        "flashcore_check_decode",
        "flashcore_decode_window",
        "flashcore_check_decode_window",
        "flashcore_decode_ex",
        "flashcore_check_decode_ex",
        "flashcore_append_kv",
        "flashcore_check_append_kv",
        "flashcore_decode_fp8kv",
        "flashcore_decode_workspace_bytes_fp8kv",
        "flashcore_check_decode_fp8kv",
        "flashcore_decode_fp8kv_window",
        "flashcore_check_decode_fp8kv_window",
        "flashcore_decode_fp8kv_ex",
        "flashcore_check_decode_fp8kv_ex",
        "flashcore_decode_varlen",
        "flashcore_decode_varlen_workspace_bytes",
        "flashcore_check_decode_varlen",
        "flashcore_append_kv_fp8kv",
        "flashcore_check_append_kv_fp8kv",
        "flashcore_merge",
        "flashcore_check_merge",
        "flashcore_fp8_workspace_bytes",
        "flashcore_quantize_fp8",
        "flashcore_check_quantize_fp8",
        "flashcore_forward_fp8",
        "flashcore_check_forward_fp8",
        "flashcore_last_error",
        "flashcore_error_name",
        "flashcore_version",
    ];
    want.sort();
    assert_eq!(
        rust.keys().map(String::as_str).collect::<Vec<_>>(),
        want,
        "entry points of src/ffi.rs"
    );
    let h_names: Vec<&String> = header.functions.keys().collect();
    let r_names: Vec<&String> = rust.keys().collect();
    assert_eq!(h_names, r_names, "functions in the header vs src/ffi.rs");
    for (name, sig) in &rust {
        assert_eq!(&header.functions[name], sig, "signature of {name}");
    }
}

/// The expected fields of each struct, in C spelling.
fn expected_fields(name: &str) -> Fields {
    let fields: &[(&str, &str)] = match name {
        "FlashcoreTensor" => &[
            ("uint64_t", "ptr"),
            ("int32_t", "dtype"),
            ("int64_t[4]", "shape"),
            ("int64_t[4]", "strides"),
        ],
        "FlashcoreKvCache" => &[
            ("FlashcoreTensor", "k"),
            ("FlashcoreTensor", "v"),
            ("uint64_t", "seqlens"),
            ("uint64_t", "block_table"),
            ("int64_t", "max_pages"),
            ("int64_t", "table_stride"),
        ],
        "FlashcoreKvScales" => &[
            ("FlashcoreTensor", "k_scale"),
            ("FlashcoreTensor", "v_scale"),
        ],
        "FlashcoreVarlen" => &[
            ("uint64_t", "cu_seqlens_q"),
            ("uint64_t", "cu_seqlens_k"),
            ("int64_t", "batch"),
            ("int64_t", "max_seqlen_q"),
        ],
        "FlashcoreFp8Operands" => &[
            ("FlashcoreTensor", "q"),
            ("FlashcoreTensor", "k"),
            ("uint64_t", "vt"),
            ("int64_t[4]", "vt_shape"),
            ("int64_t[3]", "vt_strides"),
            ("uint64_t", "q_scale"),
            ("uint64_t", "k_scale"),
            ("uint64_t", "v_scale"),
            ("uint64_t", "lse_shift"),
        ],
        "FlashcoreQuantizeOptions" => &[
            ("int32_t", "smooth_k"),
            ("int32_t", "hadamard"),
            ("uint64_t", "hadamard_seed"),
        ],
        "FlashcoreAttentionOptions" => &[
            ("uint32_t", "struct_size"),
            ("float", "softmax_scale"),
            ("int64_t", "window_left"),
            ("int64_t", "window_right"),
            ("int32_t", "causal"),
            ("float", "softcap"),
        ],
        other => panic!("no expected fields for {other}"),
    };
    fields
        .iter()
        .map(|(t, n)| (t.to_string(), n.to_string()))
        .collect()
}

/// (size, alignment) of a C field type on the 64-bit ABIs flashcore targets (LP64), for
/// the header's structs laid out by C's rules.
fn c_size_align(ty: &str, header: &Header) -> (usize, usize) {
    if let Some((elem, n)) = ty.strip_suffix(']').and_then(|t| t.split_once('[')) {
        let (size, align) = c_size_align(elem, header);
        return (size * n.parse::<usize>().expect("array length"), align);
    }
    match ty {
        "int32_t" | "uint32_t" | "float" => (4, 4),
        "int64_t" | "uint64_t" | "size_t" => (8, 8),
        _ if ty.ends_with('*') => (8, 8),
        name => {
            let (offsets, size, align) = c_layout(header.fields(name), header);
            assert_eq!(offsets.len(), header.fields(name).len());
            (size, align)
        }
    }
}

/// Each field's offset, the size and the alignment of a struct of `fields` by C's rules:
/// each field at the next multiple of its alignment, the size rounded up to the largest.
fn c_layout(fields: &Fields, header: &Header) -> (Vec<usize>, usize, usize) {
    let mut offsets = Vec::new();
    let (mut at, mut align) = (0usize, 1usize);
    for (ty, _) in fields {
        let (s, a) = c_size_align(ty, header);
        at = at.next_multiple_of(a);
        offsets.push(at);
        at += s;
        align = align.max(a);
    }
    (offsets, at.next_multiple_of(align), align)
}

/// Rust's layout of each struct: (field, offset), size, alignment.
fn rust_layout(name: &str) -> (Vec<(&'static str, usize)>, usize, usize) {
    match name {
        "FlashcoreTensor" => (
            vec![
                ("ptr", offset_of!(FlashcoreTensor, ptr)),
                ("dtype", offset_of!(FlashcoreTensor, dtype)),
                ("shape", offset_of!(FlashcoreTensor, shape)),
                ("strides", offset_of!(FlashcoreTensor, strides)),
            ],
            size_of::<FlashcoreTensor>(),
            align_of::<FlashcoreTensor>(),
        ),
        "FlashcoreKvCache" => (
            vec![
                ("k", offset_of!(FlashcoreKvCache, k)),
                ("v", offset_of!(FlashcoreKvCache, v)),
                ("seqlens", offset_of!(FlashcoreKvCache, seqlens)),
                ("block_table", offset_of!(FlashcoreKvCache, block_table)),
                ("max_pages", offset_of!(FlashcoreKvCache, max_pages)),
                ("table_stride", offset_of!(FlashcoreKvCache, table_stride)),
            ],
            size_of::<FlashcoreKvCache>(),
            align_of::<FlashcoreKvCache>(),
        ),
        "FlashcoreKvScales" => (
            vec![
                ("k_scale", offset_of!(FlashcoreKvScales, k_scale)),
                ("v_scale", offset_of!(FlashcoreKvScales, v_scale)),
            ],
            size_of::<FlashcoreKvScales>(),
            align_of::<FlashcoreKvScales>(),
        ),
        "FlashcoreVarlen" => (
            vec![
                ("cu_seqlens_q", offset_of!(FlashcoreVarlen, cu_seqlens_q)),
                ("cu_seqlens_k", offset_of!(FlashcoreVarlen, cu_seqlens_k)),
                ("batch", offset_of!(FlashcoreVarlen, batch)),
                ("max_seqlen_q", offset_of!(FlashcoreVarlen, max_seqlen_q)),
            ],
            size_of::<FlashcoreVarlen>(),
            align_of::<FlashcoreVarlen>(),
        ),
        "FlashcoreFp8Operands" => (
            vec![
                ("q", offset_of!(FlashcoreFp8Operands, q)),
                ("k", offset_of!(FlashcoreFp8Operands, k)),
                ("vt", offset_of!(FlashcoreFp8Operands, vt)),
                ("vt_shape", offset_of!(FlashcoreFp8Operands, vt_shape)),
                ("vt_strides", offset_of!(FlashcoreFp8Operands, vt_strides)),
                ("q_scale", offset_of!(FlashcoreFp8Operands, q_scale)),
                ("k_scale", offset_of!(FlashcoreFp8Operands, k_scale)),
                ("v_scale", offset_of!(FlashcoreFp8Operands, v_scale)),
                ("lse_shift", offset_of!(FlashcoreFp8Operands, lse_shift)),
            ],
            size_of::<FlashcoreFp8Operands>(),
            align_of::<FlashcoreFp8Operands>(),
        ),
        "FlashcoreQuantizeOptions" => (
            vec![
                ("smooth_k", offset_of!(FlashcoreQuantizeOptions, smooth_k)),
                ("hadamard", offset_of!(FlashcoreQuantizeOptions, hadamard)),
                (
                    "hadamard_seed",
                    offset_of!(FlashcoreQuantizeOptions, hadamard_seed),
                ),
            ],
            size_of::<FlashcoreQuantizeOptions>(),
            align_of::<FlashcoreQuantizeOptions>(),
        ),
        "FlashcoreAttentionOptions" => (
            vec![
                (
                    "struct_size",
                    offset_of!(FlashcoreAttentionOptions, struct_size),
                ),
                (
                    "softmax_scale",
                    offset_of!(FlashcoreAttentionOptions, softmax_scale),
                ),
                (
                    "window_left",
                    offset_of!(FlashcoreAttentionOptions, window_left),
                ),
                (
                    "window_right",
                    offset_of!(FlashcoreAttentionOptions, window_right),
                ),
                ("causal", offset_of!(FlashcoreAttentionOptions, causal)),
                ("softcap", offset_of!(FlashcoreAttentionOptions, softcap)),
            ],
            size_of::<FlashcoreAttentionOptions>(),
            align_of::<FlashcoreAttentionOptions>(),
        ),
        other => panic!("no Rust layout for {other}"),
    }
}

#[test]
fn types_match() {
    let header = parse_header();
    let src = read("src/ffi.rs");
    let names: Vec<&str> = header.structs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, STRUCTS, "structs of the header");
    for name in STRUCTS {
        let expect = expected_fields(name);
        assert_eq!(
            parse_rust_fields(&src, name),
            expect,
            "{name} in src/ffi.rs"
        );
        assert_eq!(header.fields(name), &expect, "{name} in the header");
    }
    assert_eq!(size_of::<FlashcoreTensor>(), 80);
    assert_eq!(size_of::<FlashcoreKvCache>(), 192);
    assert_eq!(size_of::<FlashcoreKvScales>(), 160);
    assert_eq!(size_of::<FlashcoreVarlen>(), 32);
    assert_eq!(size_of::<FlashcoreFp8Operands>(), 256);
    assert_eq!(size_of::<FlashcoreQuantizeOptions>(), 16);
    assert_eq!(size_of::<FlashcoreAttentionOptions>(), 32);

    let mut typedefs = header.typedefs.clone();
    typedefs.sort();
    assert_eq!(
        typedefs,
        [
            "FlashcoreAttentionOptions",
            "FlashcoreFp8Operands",
            "FlashcoreKvCache",
            "FlashcoreKvScales",
            "FlashcoreQuantizeOptions",
            "FlashcoreTensor",
            "FlashcoreVarlen",
            "struct CUstream_st* flashcore_stream",
            "struct FlashcoreContext FlashcoreContext",
        ]
    );
    // The stream crosses as a plain pointer.
    assert_eq!(
        std::mem::size_of::<cudarc::driver::sys::CUstream>(),
        std::mem::size_of::<*mut u8>()
    );
}

/// Every struct's C layout (from the header's fields, by C's rules) is Rust's: the same
/// offset for each field, the same size and alignment.
#[test]
fn layouts_match() {
    let header = parse_header();
    for name in STRUCTS {
        let fields = header.fields(name);
        let (offsets, size, align) = c_layout(fields, &header);
        let (rust_offsets, rust_size, rust_align) = rust_layout(name);
        let c: Vec<(&str, usize)> = fields
            .iter()
            .zip(&offsets)
            .map(|((_, n), &o)| (n.as_str(), o))
            .collect();
        assert_eq!(c, rust_offsets, "{name}: field offsets, header vs Rust");
        assert_eq!(
            (size, align),
            (rust_size, rust_align),
            "{name}: size and alignment"
        );
    }
    // The attention options have no padding either: their fields' sizes add up to the
    // struct's, so that a struct_size covers whole fields and no unset bytes.
    let header_fields = header.fields("FlashcoreAttentionOptions");
    let field_bytes: usize = header_fields
        .iter()
        .map(|(t, _)| c_size_align(t, &header).0)
        .sum();
    assert_eq!(field_bytes, size_of::<FlashcoreAttentionOptions>());
    let (offsets, _, _) = rust_layout("FlashcoreAttentionOptions");
    assert_eq!(
        offsets,
        [
            ("struct_size", 0),
            ("softmax_scale", 4),
            ("window_left", 8),
            ("window_right", 16),
            ("causal", 24),
            ("softcap", 28)
        ]
    );
    // The cache has no padding: C and Rust agree on it byte for byte, whatever the rules.
    let (offsets, _, _) = rust_layout("FlashcoreKvCache");
    assert_eq!(
        offsets,
        [
            ("k", 0),
            ("v", 80),
            ("seqlens", 160),
            ("block_table", 168),
            ("max_pages", 176),
            ("table_stride", 184)
        ]
    );
}

/// C spelling -> the ctypes spelling python/flashcore/_capi.py must use.
fn c_to_ctypes(t: &str) -> &'static str {
    match t {
        "void" => "None",
        "int32_t" => "ctypes.c_int32",
        "uint32_t" => "ctypes.c_uint32",
        "int64_t" => "ctypes.c_int64",
        "uint64_t" => "ctypes.c_uint64",
        "size_t" => "ctypes.c_size_t",
        "int64_t[4]" => "ctypes.c_int64 * 4",
        "int64_t[3]" => "ctypes.c_int64 * 3",
        "float" => "ctypes.c_float",
        "const char*" => "ctypes.c_char_p",
        "FlashcoreTensor" => "FlashcoreTensor",
        "FlashcoreContext*" | "flashcore_stream" => "ctypes.c_void_p",
        "FlashcoreContext**" => "ctypes.POINTER(ctypes.c_void_p)",
        "size_t*" => "ctypes.POINTER(ctypes.c_size_t)",
        "const int32_t*" => "ctypes.POINTER(ctypes.c_int32)",
        "const FlashcoreTensor*" => "ctypes.POINTER(FlashcoreTensor)",
        "const FlashcoreKvCache*" => "ctypes.POINTER(FlashcoreKvCache)",
        "const FlashcoreKvScales*" => "ctypes.POINTER(FlashcoreKvScales)",
        "const FlashcoreVarlen*" => "ctypes.POINTER(FlashcoreVarlen)",
        "const FlashcoreFp8Operands*" | "FlashcoreFp8Operands*" => {
            "ctypes.POINTER(FlashcoreFp8Operands)"
        }
        "const FlashcoreQuantizeOptions*" => "ctypes.POINTER(FlashcoreQuantizeOptions)",
        "const FlashcoreAttentionOptions*" => "ctypes.POINTER(FlashcoreAttentionOptions)",
        other => panic!("no ctypes spelling for {other}"),
    }
}

/// `FLASHCORE_ATTENTION_OPTIONS_INIT` is the only initializer macro, one element per field
/// of `FlashcoreAttentionOptions` in the header's order, and gives what
/// `FlashcoreAttentionOptions::new()` does: `struct_size` the header's own
/// `sizeof(FlashcoreAttentionOptions)` (the header's layout is Rust's: `layouts_match`),
/// and every option its "none".
#[test]
fn options_initializer_is_new() {
    let header = parse_header();
    assert_eq!(
        header.initializers.keys().collect::<Vec<_>>(),
        ["FLASHCORE_ATTENTION_OPTIONS_INIT"],
        "initializer macros of the header"
    );
    let init = &header.initializers["FLASHCORE_ATTENTION_OPTIONS_INIT"];
    let fields = header.fields("FlashcoreAttentionOptions");
    assert_eq!(
        init.len(),
        fields.len(),
        "FLASHCORE_ATTENTION_OPTIONS_INIT {init:?}: one element per field of {fields:?}"
    );
    // Every field set from its element, read by its C type; all bits set to start with, so
    // that a field the loop misses shows.
    let mut got = FlashcoreAttentionOptions {
        struct_size: u32::MAX,
        softmax_scale: f32::NAN,
        window_left: i64::MAX,
        window_right: i64::MAX,
        causal: i32::MAX,
        softcap: f32::NAN,
    };
    for ((ty, name), element) in fields.iter().zip(init) {
        let e = element.as_str();
        let int = || {
            e.parse::<i64>()
                .unwrap_or_else(|_| panic!("{name} = {e}: not an integer literal"))
        };
        let float = || {
            e.strip_suffix('f')
                .and_then(|f| f.parse::<f32>().ok())
                .unwrap_or_else(|| panic!("{name} = {e}: not a float literal like 0.0f"))
        };
        match (ty.as_str(), name.as_str()) {
            ("uint32_t", "struct_size") => {
                assert_eq!(
                    e, "(uint32_t)sizeof(FlashcoreAttentionOptions)",
                    "struct_size must be the header's own size"
                );
                got.struct_size = FlashcoreAttentionOptions::SIZE;
            }
            ("float", "softmax_scale") => got.softmax_scale = float(),
            ("int64_t", "window_left") => got.window_left = int(),
            ("int64_t", "window_right") => got.window_right = int(),
            ("int32_t", "causal") => got.causal = i32::try_from(int()).expect("causal"),
            ("float", "softcap") => got.softcap = float(),
            other => panic!("FLASHCORE_ATTENTION_OPTIONS_INIT: no element rule for {other:?}"),
        }
    }
    assert_eq!(
        got,
        FlashcoreAttentionOptions::new(),
        "FLASHCORE_ATTENTION_OPTIONS_INIT {init:?}"
    );
    assert_eq!(
        (got.window_left, got.window_right),
        (-1, -1),
        "no window: both sides unbounded"
    );
}

#[test]
fn python_ctypes_match() {
    let header = parse_header();
    let py = read("python/flashcore/_capi.py");

    // Constants: every FLASHCORE_X = N assignment in the script has the header's value.
    let mut n_consts = 0;
    for l in py.lines() {
        if let Some((name, value)) = l.split_once(" = ")
            && name.starts_with("FLASHCORE_")
            && !name.contains(' ')
        {
            let v: i64 = value.trim().parse().expect("constant value");
            assert_eq!(
                header.defines.get(name),
                Some(&Some(v)),
                "{name} in _capi.py"
            );
            n_consts += 1;
        }
    }
    assert!(n_consts >= 3, "_capi.py defines only {n_consts} constants");

    // Each structure's _fields_.
    for name in STRUCTS {
        let start = py
            .find(&format!("class {name}(ctypes.Structure):"))
            .unwrap_or_else(|| panic!("no {name} class in _capi.py"));
        let fields_at = py[start..].find("_fields_ = [").unwrap() + start;
        let end = py[fields_at..].find("\n    ]").unwrap() + fields_at;
        let fields: Vec<(String, String)> = py[fields_at..end]
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(|l| {
                let l = l
                    .strip_prefix("(\"")
                    .and_then(|l| l.strip_suffix("),"))
                    .unwrap_or_else(|| panic!("unexpected _fields_ line {l}"));
                let (n, t) = l.split_once("\", ").unwrap();
                (n.to_string(), t.trim().to_string())
            })
            .collect();
        let expect: Vec<(String, String)> = header
            .fields(name)
            .iter()
            .map(|(t, n)| (n.clone(), c_to_ctypes(t).to_string()))
            .collect();
        assert_eq!(fields, expect, "{name}._fields_ in _capi.py");
    }

    // SIGNATURES: one line per function, `"name": (restype, [argtypes]),`.
    let mut sigs = BTreeMap::new();
    for l in py.lines().map(str::trim) {
        let Some(l) = l.strip_prefix("\"flashcore_") else {
            continue;
        };
        let (name, rest) = l.split_once("\": (").expect("signature line");
        let rest = rest.strip_suffix("]),").expect("signature line end");
        let (ret, args) = rest.split_once(", [").expect("signature args");
        let args: Vec<String> = args
            .split(", ")
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect();
        sigs.insert(format!("flashcore_{name}"), (ret.to_string(), args));
    }
    let expect: BTreeMap<String, (String, Vec<String>)> = header
        .functions
        .iter()
        .map(|(n, (ret, params))| {
            (
                n.clone(),
                (
                    c_to_ctypes(ret).to_string(),
                    params
                        .iter()
                        .map(|(t, _)| c_to_ctypes(t).to_string())
                        .collect(),
                ),
            )
        })
        .collect();
    assert_eq!(sigs, expect, "SIGNATURES in _capi.py vs the header");
}

#[test]
fn parsers_work_on_samples() {
    assert_eq!(strip_c_comments("a /* x */ b // y\nc"), "a   b \nc");
    assert_eq!(
        split_c_decl("const FlashcoreTensor *q"),
        ("const FlashcoreTensor*".into(), "q".into())
    );
    assert_eq!(
        split_c_decl("FlashcoreContext **out"),
        ("FlashcoreContext**".into(), "out".into())
    );
    assert_eq!(
        rust_to_c("*mut *mut FlashcoreContext"),
        "FlashcoreContext**"
    );
    assert_eq!(rust_to_c("*const c_char"), "const char*");
    assert_eq!(rust_to_c("*const i32"), "const int32_t*");
    assert_eq!(rust_to_c("*mut usize"), "size_t*");
    assert_eq!(
        rust_to_c("*const FlashcoreKvCache"),
        "const FlashcoreKvCache*"
    );
    assert_eq!(rust_to_c("[i64; 4]"), "int64_t[4]");
    assert_eq!(
        return_code_lines(
            "#define FLASHCORE_F16 1 /* x */\n  #define FLASHCORE_ERROR_X 12  /* a, b */\n\
             #define FLASHCORE_SUCCESS 0\n#define FLASHCORE_H\n"
        ),
        [
            ("FLASHCORE_ERROR_X".to_string(), 12, "a, b".to_string()),
            ("FLASHCORE_SUCCESS".to_string(), 0, String::new()),
        ]
    );
}
