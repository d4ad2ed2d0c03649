#!/usr/bin/env python3
"""FP8 attention inside a model: a random-weight Llama (built from a config, no download)
run with flashcore's 16-bit attention and with its FP8 attention, same weights, same prompt.

    python3 scripts/fp8_model_check.py [--prompt 512] [--new 64] [--json OUT.json]

For each model size and each FP8 variant (plain per-block scales, with K smoothing, with
the Hadamard rotation), against the 16-bit run ("fcore"):
- logits over the prompt: relative L2 and top-1 agreement per position;
- greedy generation of --new tokens: tokens equal to the 16-bit run's, position by
  position, and the length of the identical prefix;
- teacher-forced top-1 agreement on the 16-bit run's own generated sequence (so one early
  flip does not decide every later position).
Random weights leave near-ties between tokens that any change of summation order can flip:
the same figures for SDPA against "fcore" (two 16-bit implementations) are printed as the
noise floor. And "e4m3-sim" is SDPA on q, k and v rounded to E4M3 with the same per-block
scales (one per 128 rows of each batch and head), in PyTorch: what rounding the operands
alone does to the model, so the FP8 kernel's figures can be told apart from the format's. Needs the flashcore package (the wheel, or python/ on sys.path with
FLASHCORE_LIB set) and an sm_89 or newer GPU.
"""

import argparse
import json
import os
import sys

import torch

# The model builder of the per-token benchmark (same folder, here and in the bundle).
from llama_bench import build

CONFIGS = {
    # name: (hidden, intermediate, layers, heads, kv heads); head dim = hidden / heads
    "small (2 layers, d512, D64)": (512, 1024, 2, 8, 2),
    "1B-class (16 layers, d2048, GQA 32:8, D64)": (2048, 8192, 16, 32, 8),
    "D128 (8 layers, d2048, GQA 16:4)": (2048, 5632, 8, 16, 4),
}

VARIANTS = {
    # name: environment of the FP8 backend's quantizer
    "fp8": {},
    "fp8+smooth_k": {"FLASHCORE_FP8_SMOOTH_K": "1"},
    "fp8+hadamard": {"FLASHCORE_FP8_HADAMARD_SEED": "0x5eed"},
}


SIM_NAME = "e4m3-sim"


def e4m3_round(x):
    """x [B, H, S, D] rounded to E4M3 with one scale per 128 rows of each (batch, head):
    scale = amax / 448 (1 for an all-zero block), round to nearest, saturate."""
    b, h, s, d = x.shape
    pad = (-s) % 128
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(b, h, -1, 128, d)
    amax = xf.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.view(b, h, -1, d)[:, :, :s].to(x.dtype)


def register_sim():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, e4m3_round(query), e4m3_round(key), e4m3_round(value),
                                      attention_mask, **kwargs)

    AttentionInterface.register(SIM_NAME, forward)
    AttentionMaskInterface.register(SIM_NAME, sdpa_mask)
    return SIM_NAME


def set_env(env):
    for key in ("FLASHCORE_FP8_SMOOTH_K", "FLASHCORE_FP8_HADAMARD_SEED"):
        os.environ.pop(key, None)
    os.environ.update(env)


def run(model, backend, ids, new, forced):
    """Prompt logits, greedy tokens, and the logits over `forced` (teacher forcing)."""
    model.set_attn_implementation(backend)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.float()
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
        forced_logits = None
        if forced is not None:
            forced_logits = model(forced, attention_mask=torch.ones_like(forced)).logits.float()
    return logits, gen[:, ids.shape[1]:], forced_logits


def compare(ref, other, prompt):
    (l0, g0, _), (l1, g1, f1) = ref, other
    rel_l2 = float((l1 - l0).norm() / l0.norm())
    top1 = float((l1.argmax(-1) == l0.argmax(-1)).float().mean())
    same = (g1 == g0)
    differ = (~same).any(dim=0).nonzero()
    prefix = int(differ[0]) if len(differ) else g0.shape[1]
    # Teacher forcing: logits at positions prompt-1 .. prompt+new-2 predict the generated tokens.
    forced_top1 = None
    if f1 is not None:
        pred = f1[:, prompt - 1:-1].argmax(-1)
        forced_top1 = float((pred == g0).float().mean())
    return {
        "logits_rel_l2": rel_l2,
        "prompt_top1_agreement": top1,
        "greedy_equal_fraction": float(same.float().mean()),
        "greedy_identical_prefix": prefix,
        "teacher_forced_top1_agreement": forced_top1,
        "nan_or_inf": bool(not torch.isfinite(l1).all()),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--dtype", default="f16", choices=["f16", "bf16"])
    p.add_argument("--json")
    args = p.parse_args()

    import flashcore
    from flashcore import transformers_backend

    name16 = flashcore.register_transformers()
    name8 = flashcore.register_transformers(fp8=True)
    sim = register_sim()
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    rows = []
    for label, cfg in CONFIGS.items():
        model = build(*cfg, dtype)
        torch.manual_seed(1)
        ids = torch.randint(1, 32000, (1, args.prompt), device="cuda")
        set_env({})
        ref = run(model, name16, ids, args.new, None)
        forced = torch.cat([ids, ref[1]], dim=1)
        res = {"model": label, "prompt": args.prompt, "new_tokens": args.new, "dtype": args.dtype}
        res["sdpa"] = compare(ref, run(model, "sdpa", ids, args.new, forced), args.prompt)
        res[sim] = compare(ref, run(model, sim, ids, args.new, forced), args.prompt)
        for variant, env in VARIANTS.items():
            set_env(env)
            transformers_backend.stats["flashcore_fp8"] = 0
            out = run(model, name8, ids, args.new, forced)
            res[variant] = compare(ref, out, args.prompt)
            res[variant]["fp8_calls"] = transformers_backend.stats["flashcore_fp8"]
        set_env({})
        rows.append(res)
        del model
        torch.cuda.empty_cache()

    print(f"Random-weight Llama, {args.dtype}, prompt {args.prompt}, {args.new} greedy tokens; "
          f"against flashcore's 16-bit attention; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | attention | logits rel L2 | prompt top-1 agree | greedy equal | identical prefix | "
          "teacher-forced top-1 | FP8 calls |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for variant in ["sdpa", sim, *VARIANTS]:
            m = r[variant]
            print(f"| {r['model']} | {variant} | {m['logits_rel_l2']:.2e} | {m['prompt_top1_agreement']:.3f} | "
                  f"{m['greedy_equal_fraction']:.3f} | {m['greedy_identical_prefix']}/{args.new} | "
                  f"{m['teacher_forced_top1_agreement']:.3f} | {m.get('fp8_calls', '-')} |"
                  + ("  NaN/Inf!" if m["nan_or_inf"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r["model"] for r in rows for v in VARIANTS if r[v]["nan_or_inf"] or r[v]["fp8_calls"] == 0]
    if bad:
        print(f"fp8_model_check: NaN/Inf or no FP8 call in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
