"""The official DCPythia module against dclens on the same GPU, checkpoint and tokens (issue 39).

    python3 scripts/bench_cuda_vs_official.py --module .gpu_carry/DCFormer/pytorch/dcpythia
        [--layers 32] [--T 512 2048] [--batch 1 8] [--compile] [--budget-s 200] [--out R.json]
    python3 scripts/bench_cuda_vs_official.py --module DIR --device cpu --tiny    # a dry run, here
    python3 scripts/bench_cuda_vs_official.py --print-wheels   # what gpu_carry.sh downloads

The official module is `pytorch/dcpythia` of github.com/Caiyun-AI/DCFormer, imported from
--module (scripts/gpu_carry.sh puts it in .gpu_carry/; none of its code is in this project). It
needs torch and transformers >= 4.40.2; where the interpreter's transformers is another major
version, --wheels DIR (default: the module's ../../../whl, i.e. .gpu_carry/whl) is put first on
sys.path: transformers 4.40.2 and the tokenizers / huggingface_hub its import-time check accepts.

What it does, in this order (one random checkpoint, both sides):
1. builds the official model at DCPythia-6.9B's shape (D 4096, 32 heads, F 16384, the official
   config.json; --layers of them) with random weights drawn at scales where the dynamic
   composition matters (the module's own init leaves dw1, qkw, dd at zero), in bfloat16 on the
   device, and saves it with its config as safetensors (the published layout) for dclens;
2. the official module, eager (and under torch.compile with --compile, on the first case):
   prefill tokens/s for each T x batch (best of --repeat after a warm-up), peak device memory
   (torch.cuda.max_memory_allocated), a gradient step at T 128 (logit of the last position,
   backward to the embedding output), a 16-step IG of the same logit over the embedding output
   (zero baseline, the 16 points in one batch);
3. dclens in a fresh process (--dclens-python, default this interpreter): the same checkpoint
   loaded with dtype="bfloat16" (16-bit weights, tensor-core products) and DCLENS_CUDA_KERNELS=new,
   the same cases (`forward`), `gradients` w.r.t. blocks.0.resid_pre and `attribute(steps=16)`
   there; its device memory (nvidia-smi: the process's, which its pool keeps at its peak); the
   logits also with dtype="float32" (the exact path) at the first case;
4. prints one table and writes --out (JSON): tokens/s and their ratio, memory, the logit
   differences (dclens bf16 vs official bf16, dclens bf16 vs dclens float32: max |diff| / max |ref|).

The module rounds its rotary table to float16 whatever the model's dtype (precompute_freqs_cis),
which moves its float32 logits by about 1e-3 relative from the spec's; --exact-rope replaces that
one function at run time with the spec's table (float64 angles), and then the dry run's float32
logits agree with dclens's to 6.2e-6 (2 layers, D 256, T 64; the sums of the 16-step IG
attributions 0.6783 / 0.6784), measured with the dry-run command above plus --exact-rope, in
a torch venv with transformers 4.40.2 and 5.24.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

WHEELS = ["transformers==4.40.2", "tokenizers==0.19.1", "huggingface_hub==0.23.4"]
TINY = dict(dim=256, n_head=8, n_local_heads=8, head_dim=32, intermediate_size=1024, vocab_size=512)


def best_of(fn, repeat, sync):
    """Seconds of the fastest of `repeat` calls after one warm-up."""
    fn()
    sync()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return min(ts)


# ---------------------------------------------------------------- the official side (torch)


def import_official(module_dir, wheels, exact_rope=False):
    """configuration_dcpythia.DCPythiaConfig and modeling_dcpythia.DCPythia from module_dir: with
    the interpreter's transformers, else (it is missing, or the module does not import with it)
    with the carried wheels. exact_rope: the module's rotary table (float16, whatever the model's
    dtype) replaced by one computed in float64 (model-spec's angles) for an exactness check."""
    sys.path.insert(0, os.path.abspath(module_dir))
    try:
        return _import_module(exact_rope)
    except Exception as e:  # e.g. a transformers whose PreTrainedModel the module does not fit
        if not (wheels and os.path.isdir(wheels)):
            raise
        print("the official module does not import with this transformers (%s): using %s" % (e, wheels))
    site = os.path.join(tempfile.gettempdir(), "dcpythia_site")
    if not os.path.isdir(os.path.join(site, "transformers")):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            + ["--target", site]
            + [os.path.join(wheels, w) for w in sorted(os.listdir(wheels)) if w.endswith(".whl")],
            check=True,
        )
    sys.path.insert(0, site)
    for name in [m for m in sys.modules if m.split(".")[0] in ("transformers", "tokenizers", "huggingface_hub")]:
        del sys.modules[name]
    for name in ("configuration_dcpythia", "modeling_dcpythia"):
        sys.modules.pop(name, None)
    return _import_module(exact_rope)


def _import_module(exact_rope):
    import configuration_dcpythia
    import modeling_dcpythia

    if exact_rope:
        modeling_dcpythia.precompute_freqs_cis = exact_rotary_table
    return configuration_dcpythia.DCPythiaConfig, modeling_dcpythia.DCPythia


def exact_rotary_table(seq_len, n_elem, base=10000):
    """[seq_len, n_elem/2, 2] (cos, sin) of model-spec's rotary angles t * base^(-2i/n), computed in
    float64 and kept float32 (the module rounds its table to float16)."""
    import torch

    inv = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return torch.stack([ang.cos(), ang.sin()], -1).float()


def config_dict(module_dir, a):
    with open(os.path.join(module_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(n_layer=a.layers, block_size=max(2048, max(a.T)), torch_dtype="bfloat16")
    if a.tiny:
        cfg.update(TINY)
    return cfg


def random_weights(model, seed, device):
    """Every parameter drawn where the composition matters: linear weights 1/sqrt(fan-in), the
    dynamic-weight projections likewise (the module leaves them zero), norms near 1."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith(("norm.weight", "norm.scale")) or ".scale" in name:
                v = 1 + 0.1 * torch.randn(shape, generator=g, device=device)
            elif name.endswith("bias"):
                v = 0.02 * torch.randn(shape, generator=g, device=device)
            elif name.endswith("tok_embeddings.weight"):
                v = torch.randn(shape, generator=g, device=device)
            elif name.endswith("dyn_w_proj.qkw"):  # [G, 4, K, 2I, M]
                v = torch.randn(shape, generator=g, device=device) / math.sqrt(shape[2])
            elif name.endswith(("dyn_w_proj.dw1", "dyn_w_proj.dd")):  # [D, G, ...]
                v = torch.randn(shape, generator=g, device=device) / math.sqrt(shape[0])
            elif p.ndim == 2:
                v = torch.randn(shape, generator=g, device=device) / math.sqrt(shape[1])
            else:
                continue
            p.copy_(v.to(p.dtype))


def build_official(a, DCPythiaConfig, DCPythia, out_dir):
    """The official model with random weights, in bfloat16 (float32 with --tiny on the CPU) on
    the device, saved with its config to out_dir for dclens."""
    import torch
    from safetensors.torch import save_file

    cfg = config_dict(a.module, a)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    torch.manual_seed(a.seed)
    model = DCPythia(DCPythiaConfig(**cfg))
    model = model.to(device=a.device, dtype=dtype).eval()
    random_weights(model, a.seed, a.device)
    for q in model.parameters():
        q.requires_grad_(False)  # gradients w.r.t. activations only, as dclens computes them
    with torch.device(a.device):  # the module builds its masks and rotary table on the default device
        model.setup_caches(max_batch_size=max(a.batch), max_seq_length=max(max(a.T), 128), set_kv_cache=False)
    os.makedirs(out_dir, exist_ok=True)
    derived = ("dyn_w_proj.dw_m", "dyn_w_proj.qkw_m")  # merge_weights()'s views of dw1 / qkw (unused by the prefill)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if not k.endswith(derived)}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg["torch_dtype"] = "float32" if a.device == "cpu" else "bfloat16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return model, cfg


def time_official(model, a, cfg, res, tmp):
    import torch

    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    rows = []
    with torch.no_grad():
        for T in a.T:
            for B in a.batch:
                toks = torch.from_numpy(tokens(a, cfg, B, T)).to(dev)
                if dev == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                t = best_of(lambda toks=toks: model(toks, return_tensor=True), a.repeat, sync)
                peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
                rows.append(dict(T=T, B=B, tok_s=B * T / t, s=t, peak_bytes=peak))
                print("official eager T=%d B=%d: %.0f tok/s, peak %s" % (T, B, B * T / t, gib(peak)), flush=True)
        T0, B0 = a.T[0], a.batch[0]
        lg = model(torch.from_numpy(tokens(a, cfg, B0, T0)).to(dev), return_tensor=True)
        np.save(os.path.join(tmp, "official_logits.npy"), lg.float().cpu().numpy())
    res["official"] = rows
    if a.compile and dev == "cuda" and time.time() < a.deadline - 60:
        cm = torch.compile(model)
        T, B = a.T[-1], a.batch[0]
        toks = torch.from_numpy(tokens(a, cfg, B, T)).to(dev)
        with torch.no_grad():
            t0 = time.perf_counter()
            cm(toks, return_tensor=True)
            sync()
            res["official_compile_s"] = time.perf_counter() - t0
            t = best_of(lambda: cm(toks, return_tensor=True), a.repeat, sync)
        res["official_compiled"] = dict(T=T, B=B, tok_s=B * T / t, s=t)
        print("official torch.compile T=%d B=%d: %.0f tok/s" % (T, B, B * T / t), flush=True)
    res["official_grad"] = official_grad_ig(model, a, cfg, sync)


def official_grad_ig(model, a, cfg, sync):
    """A gradient step and a 16-step IG at T 128 over the embedding output."""
    import torch

    T = 128 if not a.tiny else 32
    toks = torch.from_numpy(tokens(a, cfg, 1, T)).to(a.device)
    emb = model.tok_embeddings(toks).detach()
    feed = {}
    h = model.tok_embeddings.register_forward_hook(lambda mod, inp, out: feed["x"])

    def grad_step():
        x = emb.clone().requires_grad_(True)
        feed["x"] = x
        logit = model(toks, return_tensor=True)[0, -1, 0].float()
        (gx,) = torch.autograd.grad(logit, x)
        return gx

    def ig():
        alphas = (torch.arange(16, device=a.device, dtype=torch.float32) + 0.5) / 16
        x = (alphas[:, None, None] * emb.float()).to(emb.dtype).requires_grad_(True)
        feed["x"] = x
        logit = model(toks.expand(16, T), return_tensor=True)[:, -1, 0].float().sum()
        (gx,) = torch.autograd.grad(logit, x)
        return (gx.float().mean(0) * emb.float()).sum()

    try:
        t_g = best_of(grad_step, a.repeat, sync)
        t_ig = best_of(ig, a.repeat, sync)
        total = float(ig())
    finally:
        h.remove()
    print("official T=%d: gradient step %.3f s, 16-step IG %.3f s" % (T, t_g, t_ig), flush=True)
    return dict(T=T, grad_s=t_g, ig16_s=t_ig, ig_total=total)


# ---------------------------------------------------------------- the dclens side (its own process)

DCLENS_SRC = r"""
import json, os, subprocess, sys, time
import numpy as np
import dclens
a = json.loads(sys.argv[1])
d, tmp, dev = a["dir"], a["tmp"], a["device"]

def best_of(fn, repeat):
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return min(ts)

def device_bytes():
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        for line in out.splitlines():
            pid, mib = [x.strip() for x in line.split(",")]
            if int(pid) == os.getpid():
                return int(mib) * 2**20
    except Exception:
        pass
    return None

res = {"dclens": []}
t0 = time.perf_counter()
m = dclens.load(d, device=dev, dtype=a["dtype"])
res["load_s"] = time.perf_counter() - t0
res["dtype"] = m.dtype
for T in a["T"]:
    for B in a["batch"]:
        toks = np.asarray(a["tokens"][str(B) + "x" + str(T)])
        t = best_of(lambda: m.forward(toks), a["repeat"])
        res["dclens"].append(dict(T=T, B=B, tok_s=B * T / t, s=t))
        print("dclens %s T=%d B=%d: %.0f tok/s" % (m.dtype, T, B, B * T / t), flush=True)
res["device_bytes"] = device_bytes()
k0 = "%dx%d" % (a["batch"][0], a["T"][0])
np.save(os.path.join(tmp, "dclens_logits.npy"), m.forward(np.asarray(a["tokens"][k0])))
Tg = a["grad_T"]
tg = np.asarray(a["tokens"]["1x%d" % Tg])[0]
target = ("logit", Tg - 1, 0)
res["grad_s"] = best_of(lambda: m.gradients(tg, target, ["blocks.0.resid_pre"]), a["repeat"])
res["ig16_s"] = best_of(lambda: m.attribute(tg, target, ["blocks.0.resid_pre"], steps=16, progress=False), a["repeat"])
r = m.attribute(tg, target, ["blocks.0.resid_pre"], steps=16, progress=False)
res["ig_total"] = float(np.sum(r.attributions["blocks.0.resid_pre"]))
print("dclens T=%d: gradient step %.3f s, 16-step IG %.3f s" % (Tg, res["grad_s"], res["ig16_s"]), flush=True)
m = None
if a["exact"]:
    m32 = dclens.load(d, device=dev, dtype="float32")
    np.save(os.path.join(tmp, "dclens_f32_logits.npy"), m32.forward(np.asarray(a["tokens"][k0])))
print("RESULT " + json.dumps(res))
"""


def tokens(a, cfg, B, T):
    return np.random.default_rng(1000 * B + T).integers(0, cfg["vocab_size"], size=(B, T))


def run_dclens(a, cfg, ckpt, tmp, res):
    grad_T = 128 if not a.tiny else 32
    toks = {"%dx%d" % (B, T): tokens(a, cfg, B, T).tolist() for T in a.T for B in a.batch}
    toks["1x%d" % grad_T] = tokens(a, cfg, 1, grad_T).tolist()
    args = dict(
        dir=ckpt,
        tmp=tmp,
        device=a.device,
        dtype="float32" if a.device == "cpu" else "bfloat16",
        T=a.T,
        batch=a.batch,
        repeat=a.repeat,
        tokens=toks,
        grad_T=grad_T,
        exact=True,
    )
    env = dict(os.environ, DCLENS_CUDA_KERNELS=a.kernels)
    left = max(30, int(a.deadline - time.time()))
    r = subprocess.run(
        [a.dclens_python, "-c", DCLENS_SRC, json.dumps(args)], capture_output=True, text=True, env=env, timeout=left
    )
    sys.stdout.write("".join(line + "\n" for line in r.stdout.splitlines() if not line.startswith("RESULT ")))
    if r.returncode:
        raise SystemExit("dclens side failed:\n" + r.stderr[-3000:])
    res.update(json.loads([line for line in r.stdout.splitlines() if line.startswith("RESULT ")][-1][7:]))


def rel(x, ref):
    return float(np.abs(x.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def gib(b):
    return "-" if b is None else "%.2f GiB" % (b / 2**30)


def report(res, tmp):
    off = np.load(os.path.join(tmp, "official_logits.npy"))
    ours = np.load(os.path.join(tmp, "dclens_logits.npy")).reshape(off.shape)
    f32 = np.load(os.path.join(tmp, "dclens_f32_logits.npy")).reshape(off.shape)
    res["logits_rel_diff_vs_official"] = rel(ours, off)
    res["logits_rel_diff_vs_dclens_f32"] = rel(ours, f32)
    res["official_vs_dclens_f32"] = rel(off, f32)
    print("\n| T | batch | official eager tok/s | dclens tok/s | dclens / official | official peak | dclens device |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for o, d in zip(res["official"], res["dclens"]):
        print(
            "| %d | %d | %.0f | %.0f | %.2fx | %s | %s |"
            % (
                o["T"],
                o["B"],
                o["tok_s"],
                d["tok_s"],
                d["tok_s"] / o["tok_s"],
                gib(o["peak_bytes"]),
                gib(res["device_bytes"]),
            )
        )
    if "official_compiled" in res:
        c = res["official_compiled"]
        print(
            "official under torch.compile, T=%d B=%d: %.0f tok/s (compile %.0f s)"
            % (c["T"], c["B"], c["tok_s"], res["official_compile_s"])
        )
    g = res["official_grad"]
    print(
        "gradient step T=%d: official %.3f s, dclens %.3f s; 16-step IG: official %.3f s, dclens %.3f s "
        "(sum of the attributions: official %.4g, dclens %.4g)"
        % (g["T"], g["grad_s"], res["grad_s"], g["ig16_s"], res["ig16_s"], g["ig_total"], res["ig_total"])
    )
    print(
        "logits (first case), max |diff| / max |ref|: dclens %s vs official %.2e; dclens %s vs its float32 path %.2e; "
        "official vs dclens float32 %.2e"
        % (
            res["dtype"],
            res["logits_rel_diff_vs_official"],
            res["dtype"],
            res["logits_rel_diff_vs_dclens_f32"],
            res["official_vs_dclens_f32"],
        )
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", help="the official pytorch/dcpythia folder")
    p.add_argument("--wheels", default=None, help="wheels of transformers 4.x and its checked dependencies")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time the official module under torch.compile")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="D 256, 8 heads, vocab 512 (a dry run)")
    p.add_argument("--kernels", default="new", help="DCLENS_CUDA_KERNELS for the dclens side")
    p.add_argument("--dclens-python", default=sys.executable)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    p.add_argument("--print-wheels", action="store_true")
    p.add_argument(
        "--exact-rope", action="store_true", help="the module's float16 rotary table replaced by an exact one"
    )
    a = p.parse_args(argv)
    if a.print_wheels:
        print(" ".join(WHEELS))
        return 0
    if not a.module:
        p.error("--module is required")
    a.deadline = time.time() + a.budget_s
    if a.wheels is None:
        a.wheels = os.path.join(os.path.abspath(a.module), "..", "..", "..", "whl")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("no GPU (torch.cuda.is_available() is False)")
        return 0
    DCPythiaConfig, DCPythia = import_official(a.module, a.wheels, a.exact_rope)
    import transformers

    res = dict(
        layers=a.layers,
        T=a.T,
        batch=a.batch,
        torch=torch.__version__,
        transformers=transformers.__version__,
        kernels=a.kernels,
        exact_rope=a.exact_rope,
    )
    if a.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.keep or os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        model, cfg = build_official(a, DCPythiaConfig, DCPythia, ckpt)
        res["build_s"] = time.perf_counter() - t0
        print("checkpoint: %d layers, D %d, written in %.0f s" % (a.layers, cfg["dim"], res["build_s"]), flush=True)
        time_official(model, a, cfg, res, tmp)
        del model
        if a.device == "cuda":
            torch.cuda.empty_cache()
        run_dclens(a, cfg, ckpt, tmp, res)
        report(res, tmp)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
