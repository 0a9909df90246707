"""The official DCPythia module against dclens: one GPU, one random checkpoint, the same tokens (issue 39).

On the lent GPU machine (torch, transformers, nvidia-ml-py, dclens built with CUDA; no network),
from the repository root, with `.gpu_carry/` carried (made by `bash scripts/gpu_carry.sh`):

    python3 scripts/bench_cuda_vs_official.py --module .gpu_carry/DCFormer/pytorch/dcpythia \\
        --wheels .gpu_carry/whl --budget-s 240 --out /tmp/official.json
        [--layers 32] [--T 512 2048] [--batch 1 8] [--no-compile] [--dtype bfloat16]

The module asks for transformers >= 4.40.2 (pytorch/requirements.txt). It is imported with the
interpreter's transformers when a 1-layer model of it builds and runs with it (5.17.0 does: its
forward uses torch alone). Otherwise the wheels in --wheels (transformers 4.40.2, tokenizers 0.19.1,
huggingface_hub 0.23.4: `--print-wheels`) are installed into /tmp/dcpythia_site and put first on
sys.path; torch stays the machine's. The same by hand:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_carry/whl/*.whl
    PYTHONPATH=/tmp/site python3 scripts/bench_cuda_vs_official.py --module .gpu_carry/DCFormer/pytorch/dcpythia

A dry run of the whole pipeline on the CPU (2 layers, D 256, 8 heads, vocab 512, window 16, T 64),
with torch in a venv of its own and dclens in the project's python:

    VENV/bin/python scripts/bench_cuda_vs_official.py --module .gpu_carry/DCFormer/pytorch/dcpythia \\
        --device cpu --tiny --dclens-python python3 [--dtype float32]

What it does, within --budget-s (a case that would not fit is skipped and says so; the official
module eager gets at most a quarter of what is left after the checkpoint, dclens all but what is
kept for torch.compile, min(90 s, 30%)):
1. builds the official model (`pytorch/dcpythia` of github.com/Caiyun-AI/DCFormer, imported from
   --module; none of its code is in this project) at DCPythia-6.9B's shape (its config.json: D 4096,
   32 heads, F 16384, vocab 50257, window 256 on even layers; --layers of them) on the device in
   --dtype, draws every parameter at random (below), and writes it as one safetensors file with its
   config.json, which dclens loads: both sides run the same weights;
2. the official module, eager: prefill tokens/s per T x batch (the fastest of --repeat calls after
   one), peak memory (torch.cuda.max_memory_allocated) and the process's device memory; at T
   --grad-T (128) the gradient of the logit of token 0 at the last position w.r.t. the embedding
   output (torch autograd) and a 16-step integrated gradients of it there (zero baseline,
   midpoints, the steps in one batch); the logits at the reference case (B 1, T --ref-T, default
   the smallest T); then the same module in float32 with the spec's rotary table (the module
   rounds its own to float16) on the same weights: the reference;
3. dclens in its own process (--dclens-python; `--worker`): `load(dtype=--dtype)`, the same cases
   (`forward`: full logits, copied to the host), `gradients(..., ["blocks.0.resid_pre"])` and
   `attribute(steps=16)` at the same target, its device memory after each case (NVML: the
   process's, or the device's growth since it started; its pool keeps what it took, so this is its
   peak so far), then `load(dtype="float32")`: the exact path, against the reference;
4. the official module under torch.compile (on CUDA unless --no-compile; --compile forces it on the
   CPU): each block compiled (the blocks share their graphs), the same cases in what is left of the
   budget (a shape's first call compiles: its time is reported; an alarm stops a compile at the end);
5. one table, the differences (max |diff| / max |ref|) of logits, gradients and IG totals against
   the reference, and --out (JSON, written before step 4 too); exit 1 if dclens's float32 logits
   miss the reference by more than --tol or the dclens side failed.

The random weights: linear maps N(0, 1/fan_in), the outputs of the residual branches (wo, w2)
times 0.2, the dynamic-weight projections dw1 N(0, 1/D), qkw N(0, 1/K) * 0.6/sqrt(heads), dd
N(0, 1/D) * 0.2, norms 1 + N(0, 0.01), biases N(0, 4e-4), embeddings N(0, 1). Composition matters
at these scales (zeroing qkw and dd moves the logits by ~50% of their largest) but the model is not
chaotic: with qkw and dd at 1/sqrt(fan_in), 32 layers amplify a 1e-7 perturbation of the
embeddings to 2e-2 of the logits and rounding the embeddings to bfloat16 moves them by 100%, which
would leave nothing to compare; here 9e-7 and 3e-3 (D 1024, 32 heads, 32 layers, on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

WHEELS = ["transformers==4.40.2", "tokenizers==0.19.1", "huggingface_hub==0.23.4"]
TINY = dict(dim=256, n_head=8, n_local_heads=8, head_dim=32, intermediate_size=1024, vocab_size=512, window_size=16)
SCALES = dict(out=0.2, qkw=0.6, dd=0.2)  # see the docstring


# ------------------------------------------------------------------------------------ shared


def case_cost(T, B):
    """A forward's relative cost: the products grow as B*T, the attention maps as B*T*T."""
    return B * T * (T + 2048)


def make_cases(Ts, Bs):
    """[(T, B)], cheapest first, so that the budget cuts the dearest."""
    return sorted(((T, B) for T in Ts for B in Bs), key=lambda c: case_cost(*c))


def tokens(vocab, B, T):
    return np.random.default_rng(1000 * B + T).integers(0, vocab, size=(B, T))


def timed(fn, repeat, deadline, floor_s=0.5):
    """{"s": the fastest of `repeat` calls after a first one (up to 10 while they add up to under
    floor_s), fewer where the deadline comes first ("n" of them; n 0: the first call's time),
    "first_s"}."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    ts = []
    while (len(ts) < repeat or (sum(ts) < floor_s and len(ts) < 10)) and time.time() + first < deadline:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return dict(s=min(ts) if ts else first, first_s=first, n=len(ts))


def fits(done, T, B, deadline, factor):
    """Whether case (T, B) is predicted (from the last case done, by case_cost) to take under
    factor x its time before the deadline."""
    if not done:
        return True
    last = done[-1]
    return time.time() + factor * last["s"] * case_cost(T, B) / case_cost(last["T"], last["B"]) < deadline


def gpu_memory(pid):
    """(bytes process `pid` holds on GPU 0, bytes used on GPU 0): NVML, else nvidia-smi; None
    for what neither says (in a container NVML may list host pids)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid]
        return (mine[0] if mine else None), int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    except Exception:
        pass
    try:
        q = ["nvidia-smi", "--format=csv,noheader,nounits", "-i", "0"]
        apps = subprocess.run(q + ["--query-compute-apps=pid,used_memory"], capture_output=True, text=True, timeout=20)
        used = subprocess.run(q + ["--query-gpu=memory.used"], capture_output=True, text=True, timeout=20)
        mine = [
            int(m) << 20 for p, m in (ln.split(",") for ln in apps.stdout.splitlines() if "," in ln) if int(p) == pid
        ]
        return (mine[0] if mine else None), int(used.stdout.split()[0]) << 20
    except Exception:
        return None, None


class DeviceMemory:
    """memory() -> (bytes, how): this process's memory on GPU 0 as NVML (or nvidia-smi) counts it
    for its pid, else the growth of the device's used memory since DeviceMemory(True) was made
    (then no other process may grow meanwhile: the two sides run one after the other)."""

    def __init__(self, on):
        self.on = on
        self.base = gpu_memory(os.getpid())[1] if on else None

    def __call__(self):
        if not self.on:
            return None, None
        mine, used = gpu_memory(os.getpid())
        if mine is None and used is not None and self.base is not None:
            return used - self.base, "device growth"
        return mine, "process"


def rel(x, ref):
    """max |x - ref| / max |ref|."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64).reshape(np.shape(x))
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


# ------------------------------------------------------------------------- the official module


def import_official(module_dir, wheels):
    """(DCPythiaConfig, DCPythia) of module_dir, with the interpreter's transformers if the module
    builds and runs with it, else with the wheels in `wheels` (installed into /tmp/dcpythia_site)."""
    sys.path.insert(0, os.path.abspath(module_dir))
    try:
        return smoke(*_import_module())
    except Exception as e:
        if not (wheels and os.path.isdir(wheels)):
            raise
        print("the official module does not run with this transformers (%r): using %s" % (e, wheels), flush=True)
    site = os.path.join(tempfile.gettempdir(), "dcpythia_site")
    if not os.path.isdir(os.path.join(site, "transformers")):
        whl = [os.path.join(wheels, w) for w in sorted(os.listdir(wheels)) if w.endswith(".whl")]
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run(pip + ["--target", site] + whl, check=True)
    sys.path.insert(0, site)
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top in ("transformers", "tokenizers", "huggingface_hub", "configuration_dcpythia", "modeling_dcpythia"):
            del sys.modules[name]
    return smoke(*_import_module())


def _import_module():
    import configuration_dcpythia
    import modeling_dcpythia

    return configuration_dcpythia.DCPythiaConfig, modeling_dcpythia.DCPythia


def smoke(Config, Model):
    """(Config, Model) once a 1-layer model of them has run a forward on the CPU."""
    import torch

    m = Model(Config(dim=32, n_head=4, n_layer=1, vocab_size=16, use_qk_norm=True)).float().eval()
    m.setup_caches(1, 8, set_kv_cache=False)
    with torch.no_grad():
        m(torch.zeros(1, 4, dtype=torch.long), return_tensor=True)
    return Config, Model


def spec_rotary_table(seq_len, n_elem, base, device):
    """[seq_len, n_elem/2, 2] (cos, sin) of model-spec's angles t * base^(-2i/n), computed in
    float64 and kept float32 (the module's precompute_freqs_cis rounds its table to float16)."""
    import torch

    inv = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return torch.stack([ang.cos(), ang.sin()], -1).float().to(device)


def model_config(a):
    with open(os.path.join(a.module, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(TINY if a.tiny else {})
    cfg.update(n_layer=a.layers, block_size=max([2048, a.ref_T, a.grad_T] + a.T), torch_dtype=a.dtype)
    return cfg


def draw_weights(model, n_head, seed):
    """Every parameter drawn at random at the scales of the docstring (the module's own init
    leaves dw1, qkw and dd at zero: no composition)."""
    import torch

    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = torch.randn(p.shape, generator=g, device=dev)
            if name.endswith(("dw_m", "qkw_m")):
                continue  # merge_weights()'s copies of dw1 / qkw, remade by setup_caches
            if name.endswith(("norm.weight", ".scale")):
                v = 1 + 0.1 * v
            elif name.endswith("bias"):
                v = 0.02 * v
            elif name.endswith("dyn_w_proj.qkw"):  # [G, 4, K, 2I, M]
                v *= SCALES["qkw"] / math.sqrt(p.shape[2] * n_head)
            elif name.endswith("dyn_w_proj.dd"):  # [D, G, 4N]
                v *= SCALES["dd"] / math.sqrt(p.shape[0])
            elif name.endswith("dyn_w_proj.dw1"):  # [D, G, 4, K]
                v /= math.sqrt(p.shape[0])
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                v *= SCALES["out"] / math.sqrt(p.shape[1])
            elif p.ndim == 2 and not name.endswith("tok_embeddings.weight"):
                v /= math.sqrt(p.shape[1])
            p.copy_(v.to(p.dtype))


def build_official(a, Config, Model, cfg):
    """The official model with random weights, built on the device in a.dtype, ready for prefill."""
    import torch

    dtype = getattr(torch, a.dtype)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(a.device):
            model = Model(Config(**cfg))
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype).eval()  # the module makes dw1, qkw, dd and its eye buffers float16
    draw_weights(model, cfg["n_head"], a.seed)
    model.requires_grad_(False)  # gradients w.r.t. activations only, as dclens's `gradients` here
    with torch.device(a.device):  # it makes its masks and rotary table on the default device
        model.setup_caches(max(a.batch + [a.ig_steps]), cfg["block_size"], set_kv_cache=False)
    return model


def save_checkpoint(model, cfg, out_dir):
    """config.json and model.safetensors (the published tensor names), written tensor by tensor."""
    import torch

    os.makedirs(out_dir, exist_ok=True)
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith(("dw_m", "qkw_m"))}
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        header[k] = dict(dtype=names[v.dtype], shape=list(v.shape), data_offsets=[off, off + n])
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for v in sd.values():
            f.write(v.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return 8 + len(h) + off


def official_cases(model, a, cfg, cases, deadline, label, memory):
    """Prefill tokens/s and memory of each case (skipped where the deadline would pass): peak
    allocated (torch) and the process's device memory after it (`memory`, a DeviceMemory)."""
    import torch

    cuda = a.device == "cuda"
    rows, done = [], []
    for T, B in cases:
        if not fits(done, T, B, deadline, 1 + a.repeat):
            rows.append(dict(T=T, B=B, skipped="budget"))
            continue
        x = torch.from_numpy(tokens(cfg["vocab_size"], B, T)).to(a.device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        def call(x=x):
            with torch.no_grad():
                model(x, return_tensor=True)
            if cuda:
                torch.cuda.synchronize()

        r = dict(T=T, B=B, **timed(call, a.repeat, deadline))
        r["tok_s"] = B * T / r["s"]
        if cuda:
            r["peak_bytes"] = torch.cuda.max_memory_allocated()
            r["reserved_bytes"] = torch.cuda.max_memory_reserved()
            r["device_bytes"], r["memory_from"] = memory()
        rows.append(r)
        done.append(r)
        print("%s T=%d B=%d: %.0f tok/s, peak %s" % (label, T, B, r["tok_s"], gib(r.get("peak_bytes"))), flush=True)
    return rows


def official_grad_ig(model, a, cfg, timing):
    """At T a.grad_T: d logit[last, 0] / d embedding output (one backward), and IG of it there
    with a.ig_steps midpoints of a zero baseline in one batch. Returns (dict, gradient [T, D])."""
    import torch

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    T, S = a.grad_T, a.ig_steps
    x = torch.from_numpy(tokens(cfg["vocab_size"], 1, T)).to(a.device)
    emb = model.tok_embeddings(x).detach()
    feed = {}
    hook = model.tok_embeddings.register_forward_hook(lambda mod, inp, out: feed["x"])

    def grad_step():
        feed["x"] = emb.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(model(x, return_tensor=True)[0, -1, 0].float(), feed["x"])
        sync()
        return g

    def ig():
        alphas = (torch.arange(S, device=a.device, dtype=torch.float32) + 0.5) / S
        feed["x"] = (alphas[:, None, None] * emb.float()).to(emb.dtype).requires_grad_(True)
        logit = model(x.expand(S, T), return_tensor=True)[:, -1, 0].float().sum()
        (g,) = torch.autograd.grad(logit, feed["x"])
        sync()
        return float((g.float().mean(0) * emb[0].float()).sum())

    try:
        r = dict(T=T, steps=S, ig_total=ig())
        g = grad_step().float()[0].cpu().numpy()
        if timing:
            r["grad_s"] = timed(grad_step, a.repeat, math.inf)["s"]
            r["ig_s"] = timed(ig, a.repeat, math.inf)["s"]
    finally:
        hook.remove()
    return r, g


def official_logits(model, a, cfg):
    import torch

    x = torch.from_numpy(tokens(cfg["vocab_size"], 1, a.ref_T)).to(a.device)
    with torch.no_grad():
        return model(x, return_tensor=True).float()[0].cpu().numpy()


def official_side(model, a, cfg, cases, deadline, tmp, memory):
    """Step 2 of the docstring: eager cases, gradient and IG, reference logits. The model is back
    in a.dtype with its own rotary table afterwards."""
    import torch

    res = dict(cases=official_cases(model, a, cfg, cases, deadline, "official eager", memory))
    arrays = dict(logits=official_logits(model, a, cfg))
    res["grad"], arrays["grad"] = official_grad_ig(model, a, cfg, timing=True)
    print(
        "official T=%d: gradient step %.3f s, %d-step IG %.3f s"
        % (a.grad_T, res["grad"]["grad_s"], a.ig_steps, res["grad"]["ig_s"]),
        flush=True,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    own_table = model.freqs_cis
    model.float()
    model.freqs_cis = spec_rotary_table(own_table.shape[0], own_table.shape[1] * 2, cfg["rope_base"], a.device)
    arrays["ref_logits"] = official_logits(model, a, cfg)
    res["ref_grad"], arrays["ref_grad"] = official_grad_ig(model, a, cfg, timing=False)
    model.to(getattr(torch, a.dtype))
    model.freqs_cis = own_table
    np.savez(os.path.join(tmp, "official.npz"), **arrays)
    return res


class OverBudget(Exception):
    pass


@contextlib.contextmanager
def alarm_at(deadline):
    """Raise OverBudget in the main thread at `deadline`, and every second after it until the
    block is left (torch.compile cannot be told to stop, and may catch the first one)."""

    def ring(signum, frame):
        raise OverBudget()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(0.5, deadline - time.time()), 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def compiled_side(model, a, cfg, cases, deadline, memory):
    """Step 4: each block under torch.compile (one graph for all blocks, a shape's first call
    compiles), the same cases while the budget lasts."""
    for layer in model.layers:
        layer.compile()
    rows = []
    try:
        with alarm_at(deadline):
            for T, B in cases:
                rows += official_cases(model, a, cfg, [(T, B)], deadline, "official compiled", memory)
    except Exception as e:  # OverBudget, or what torch.compile made of it
        over = isinstance(e, OverBudget) or time.time() >= deadline
        print("official compiled: %s" % ("the budget ran out" if over else "failed: %r" % e), flush=True)
        if not over:
            rows.append(dict(T=cases[len(rows)][0], B=cases[len(rows)][1], skipped="error: %r" % e))
    for T, B in cases[len(rows) :]:
        rows.append(dict(T=T, B=B, skipped="budget"))
    return rows


# ---------------------------------------------------------------------------- the dclens side


def run_dclens(a, ckpt, cases, tmp, deadline):
    """Step 3 in a fresh process of --dclens-python; its RESULT lines merged into one dict (what
    it printed before a timeout is kept)."""
    job = dict(
        ckpt=ckpt,
        tmp=tmp,
        device=a.device,
        dtype=a.dtype,
        cases=cases,
        repeat=a.repeat,
        grad_T=a.grad_T,
        ref_T=a.ref_T,
        ig_steps=a.ig_steps,
        deadline=deadline,
    )
    with open(os.path.join(tmp, "job.json"), "w") as f:
        json.dump(job, f)
    env = dict(os.environ, DCLENS_CUDA_KERNELS=a.kernels)
    cmd = [a.dclens_python, os.path.abspath(__file__), "--worker", os.path.join(tmp, "job.json")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(30, deadline - time.time() + 30))
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = _text(e.stdout), _text(e.stderr) + "\n(timed out)", "timeout"
    res = parse_results(out, echo=True)
    if rc:
        print("dclens side exited %s:\n%s" % (rc, err[-3000:]), flush=True)
        res["errors"]["exit"] = "%s: %s" % (rc, err[-500:])
    return res


def parse_results(out, echo=False):
    """The worker's RESULT lines merged (a later one replaces a key, errors add up); the other
    lines printed with echo."""
    res = dict(errors={})
    for line in out.splitlines():
        if line.startswith("RESULT "):
            part = json.loads(line[7:])
            res["errors"].update(part.pop("errors", {}))
            res.update(part)
        elif echo:
            print(line, flush=True)
    return res


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def worker(job_path):
    """The dclens side (no torch): reads the job, prints RESULT lines of JSON, saves arrays to its
    folder. A phase that fails says so (RESULT errors) and the next one still runs."""
    import dclens

    with open(job_path) as f:
        job = json.load(f)
    toks = dict(np.load(os.path.join(job["tmp"], "tokens.npz")))
    cuda = job["device"] == "cuda"
    memory = DeviceMemory(cuda)
    state = dict(load_s=30.0)
    for name, phase in (("native", _native_phase), ("float32", _float32_phase)):
        try:
            phase(dclens, job, toks, memory, state)
        except Exception as e:
            import traceback

            traceback.print_exc()
            _result(errors={name: repr(e)[:500]})
        state.pop("model", None)
    return 0


def _result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def _target(job, toks):
    """(tokens, target, hooks) of the gradient and IG: the logit of token 0 at the last position."""
    return toks["B1_T%d" % job["grad_T"]][0], ("logit", job["grad_T"] - 1, 0), ["blocks.0.resid_pre"]


def _native_phase(dclens, job, toks, memory, state):
    """dclens in job["dtype"]: reference logits, gradient, IG, then the cases while time lasts
    (keeping time for the float32 phase)."""
    tmp, deadline = job["tmp"], job["deadline"]
    t0 = time.perf_counter()
    m = state["model"] = load(dclens, job["ckpt"], job["device"], job["dtype"])
    state["load_s"] = time.perf_counter() - t0
    _result(load_s=state["load_s"], dtype=m.dtype, memory_after_load=memory()[0])
    np.save(os.path.join(tmp, "dclens_logits.npy"), m.forward(toks["B1_T%d" % job["ref_T"]][0]))
    g, target, at = _target(job, toks)
    np.save(os.path.join(tmp, "dclens_grad.npy"), m.gradients(g, target, at)[at[0]])
    out = {}
    ig = timed(lambda: out.update(a=m.attribute(g, target, at, steps=job["ig_steps"], progress=False)), 1, deadline)
    grad = dict(
        grad_s=timed(lambda: m.gradients(g, target, at), job["repeat"], deadline)["s"],
        ig_s=ig["s"],
        ig_total=float(np.sum(out["a"].attributions[at[0]])),
    )
    _result(grad=grad)
    print(
        "dclens T=%d: gradient step %.3f s, %d-step IG %.3f s"
        % (job["grad_T"], grad["grad_s"], job["ig_steps"], ig["s"]),
        flush=True,
    )

    end = deadline - (15 + 2.5 * state["load_s"])  # the float32 phase loads twice the bytes
    rows, done = [], []
    for T, B in job["cases"]:
        if not fits(done, T, B, end, 1 + job["repeat"]):
            rows.append(dict(T=T, B=B, skipped="budget"))
            continue
        x = toks["B%d_T%d" % (B, T)]
        r = dict(T=T, B=B, **timed(lambda x=x: m.forward(x), job["repeat"], end))
        r["tok_s"] = B * T / r["s"]
        r["device_bytes"], r["memory_from"] = memory()
        rows.append(r)
        done.append(r)
        _result(cases=rows)
        print(
            "dclens %s T=%d B=%d: %.0f tok/s, device %s" % (m.dtype, T, B, r["tok_s"], gib(r["device_bytes"])),
            flush=True,
        )
    _result(cases=rows)


def _float32_phase(dclens, job, toks, memory, state):
    """dclens in float32 (the exact path) on the same file: logits, gradient and IG total."""
    state.pop("model", None)
    gc.collect()  # the 16-bit model's memory back before the float32 one is loaded
    if time.time() + 10 + 2 * state["load_s"] > job["deadline"] + 25:
        _result(f32=dict(skipped="budget"))
        return
    tmp = job["tmp"]
    m = state["model"] = load(dclens, job["ckpt"], job["device"], "float32")
    np.save(os.path.join(tmp, "dclens_f32_logits.npy"), m.forward(toks["B1_T%d" % job["ref_T"]][0]))
    g, target, at = _target(job, toks)
    np.save(os.path.join(tmp, "dclens_f32_grad.npy"), m.gradients(g, target, at)[at[0]])
    ig = m.attribute(g, target, at, steps=job["ig_steps"], progress=False).attributions[at[0]]
    _result(f32=dict(dtype=m.dtype, ig_total=float(np.sum(ig))))


def load(dclens, path, device, dtype):
    """dclens.load with dtype=, or without it (a dclens from before load's dtype=: float32)."""
    try:
        return dclens.load(path, device=device, dtype=dtype)
    except TypeError:
        return dclens.load(path, device=device)


# ------------------------------------------------------------------------------------ the report


def gib(b):
    return "-" if b is None else "%.2f GiB" % (b / 2**30)


def accuracy(res, tmp):
    """{row: {"logits", "grad", "ig_total"}}: max |diff| / max |ref| against the reference (the
    official module in float32 with the spec's rotary table, same weights), and dclens against the
    official module in the same dtype."""
    off = dict(np.load(os.path.join(tmp, "official.npz")))
    dt = res["setup"]["dtype"]
    dcl = res.get("dclens", {})

    def mine(name):
        path = os.path.join(tmp, "dclens_%s.npy" % name)
        return np.load(path) if os.path.exists(path) else None

    rows = {"reference": dict(logits=0.0, grad=0.0, ig_total=res["official"]["ref_grad"]["ig_total"])}
    rows["official " + dt] = dict(
        logits=rel(off["logits"], off["ref_logits"]),
        grad=rel(off["grad"], off["ref_grad"]),
        ig_total=res["official"]["grad"]["ig_total"],
    )
    for label, pre, ig in (("dclens " + dt, "", dcl.get("grad")), ("dclens float32 load", "f32_", dcl.get("f32"))):
        logits, grad = mine(pre + "logits"), mine(pre + "grad")
        if logits is not None and grad is not None:
            rows[label] = dict(
                logits=rel(logits, off["ref_logits"]),
                grad=rel(grad, off["ref_grad"]),
                ig_total=(ig or {}).get("ig_total"),
            )
    if mine("logits") is not None and mine("grad") is not None:
        rows["dclens vs official, both " + dt] = dict(
            logits=rel(mine("logits"), off["logits"]), grad=rel(mine("grad"), off["grad"]), ig_total=None
        )
    return rows


def report(res):
    s = res["setup"]
    print(
        "\n%d layers, D %d, %d heads, vocab %d, %s weights, %s (%s); torch %s, transformers %s, DCLENS_CUDA_KERNELS=%s"
        % (
            s["layers"],
            s["dim"],
            s["heads"],
            s["vocab"],
            s["dtype"],
            s["device"],
            s.get("gpu", "-"),
            s["torch"],
            s["transformers"],
            s["kernels"],
        )
    )
    print(
        "checkpoint %.2f GiB: built in %.0f s, written in %.0f s"
        % (s["checkpoint_bytes"] / 2**30, s["build_s"], s["save_s"])
    )
    by = {}
    for side in ("official", "compiled", "dclens"):
        for r in res.get(side, {}).get("cases", []):
            by.setdefault((r["T"], r["B"]), {})[side] = r
    cols = ["T", "B", "official eager tok/s", "official compiled tok/s", "dclens tok/s", "dclens / eager"]
    cols += ["dclens / compiled", "official peak allocated", "official device", "dclens device"]
    print("\n| %s |\n|%s" % (" | ".join(cols), "---:|" * len(cols)))
    for (T, B), c in sorted(by.items(), key=lambda kv: case_cost(*kv[0])):
        o, k, d = (c.get(x, {}) for x in ("official", "compiled", "dclens"))
        cells = [
            _tok(o),
            _tok(k),
            _tok(d),
            _ratio(d, o),
            _ratio(d, k),
            gib(o.get("peak_bytes")),
            gib(o.get("device_bytes")),
            gib(d.get("device_bytes")),
        ]
        print("| %d | %d | %s |" % (T, B, " | ".join(cells)))
    firsts = [
        "T%d B%d %.0f s" % (r["T"], r["B"], r["first_s"])
        for r in res.get("compiled", {}).get("cases", [])
        if "first_s" in r
    ]
    if firsts:
        print("torch.compile, first call of each shape (compiles): " + ", ".join(firsts))
    for phase, e in res.get("dclens", {}).get("errors", {}).items():
        print("dclens side, %s: %s" % (phase, e))
    og, dg = res["official"]["grad"], res.get("dclens", {}).get("grad")
    if dg:
        print(
            "\nT %d: gradient step official %.3f s, dclens %.3f s; %d-step IG official %.3f s, dclens %.3f s"
            % (og["T"], og["grad_s"], dg["grad_s"], og["steps"], og["ig_s"], dg["ig_s"])
        )
    print(
        "\nmax |diff| / max |ref| against the reference: the official module in float32 with the spec's rotary table,"
    )
    print("same weights (logits: B 1, T %d; gradient w.r.t. the embedding output: T %d)" % (s["ref_T"], s["grad_T"]))
    print("\n| | logits | gradient | IG total |")
    print("|---|---:|---:|---:|")
    for name, d in res["accuracy"].items():
        ig = "-" if d["ig_total"] is None else "%.5g" % d["ig_total"]
        print("| %s | %.2e | %.2e | %s |" % (name, d["logits"], d["grad"], ig))


def _tok(r):
    return "%.0f" % r["tok_s"] if "tok_s" in r else r.get("skipped", "-")


def _ratio(a, b):
    return "%.2fx" % (a["tok_s"] / b["tok_s"]) if "tok_s" in a and "tok_s" in b else "-"


# ---------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", help="the official pytorch/dcpythia folder")
    p.add_argument(
        "--wheels",
        default=None,
        help="transformers 4.40.2 and the wheels its check needs (default: MODULE/../../../whl)",
    )
    p.add_argument("--layers", type=int, default=None, help="default 32 (--tiny: 2)")
    p.add_argument("--T", type=int, nargs="+", default=None, help="default 512 2048 (--tiny: 64)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 8 (--tiny: 1 2)")
    p.add_argument("--grad-T", type=int, default=None, help="gradient and IG length, default 128 (--tiny: 32)")
    p.add_argument("--ref-T", type=int, default=None, help="the float32 reference's length, default min(--T)")
    p.add_argument("--ig-steps", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeat", type=int, default=2, help="timed calls after the first")
    p.add_argument(
        "--compile", dest="compile", action="store_true", default=None, help="time torch.compile (default on CUDA)"
    )
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="D 256, 8 heads, vocab 512, window 16 (a dry run)")
    p.add_argument("--kernels", default="new", help="DCLENS_CUDA_KERNELS for the dclens side")
    p.add_argument("--dclens-python", default=sys.executable)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument(
        "--tol", type=float, default=None, help="dclens float32 vs the reference, default 1e-3 (--tiny: 1e-4)"
    )
    p.add_argument("--out", default=None, help="the results as JSON")
    p.add_argument("--keep", default=None, help="write the checkpoint to this folder and keep it")
    p.add_argument("--print-wheels", action="store_true", help="the pip requirements of the fallback wheels")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    # the reference always runs the spec's rotary table now; kept for the commands of the diary
    p.add_argument("--exact-rope", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.layers = a.layers or (2 if a.tiny else 32)
    a.T = a.T or ([64] if a.tiny else [512, 2048])
    a.batch = a.batch or ([1, 2] if a.tiny else [1, 8])
    a.grad_T = a.grad_T or (32 if a.tiny else 128)
    a.ref_T = a.ref_T or min(a.T)
    a.tol = a.tol or (1e-4 if a.tiny else 1e-3)
    a.compile = a.device == "cuda" if a.compile is None else a.compile
    if not (a.print_wheels or a.worker or a.module):
        p.error("--module is required")
    if a.wheels is None and a.module:
        a.wheels = os.path.join(os.path.abspath(a.module), "..", "..", "..", "whl")
    return a


def describe(a, cfg):
    import torch
    import transformers

    setup = dict(layers=a.layers, dim=cfg["dim"], heads=cfg["n_head"], vocab=cfg["vocab_size"], dtype=a.dtype)
    setup.update(device=a.device, T=a.T, batch=a.batch, ref_T=a.ref_T, grad_T=a.grad_T, budget_s=a.budget_s)
    setup.update(torch=torch.__version__, transformers=transformers.__version__, kernels=a.kernels, scales=SCALES)
    if a.device == "cuda":
        setup["gpu"] = torch.cuda.get_device_name()
    return setup


def verdict(res, a):
    """res["ok"]: dclens's float32 logits within --tol of the reference and no dclens error
    (None: not measured, the budget ran out first)."""
    f32 = res.get("accuracy", {}).get("dclens float32 load", {}).get("logits")
    errors = res.get("dclens", {}).get("errors")
    res["ok"] = False if errors else (None if f32 is None else f32 <= a.tol)
    return "dclens float32 logits vs the reference: %s (tolerance %.0e)%s" % (
        "not measured" if f32 is None else "%.2e" % f32,
        a.tol,
        "; dclens errors: %s" % ", ".join(errors) if errors else "",
    )


def write(res, a):
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def main(argv=None):
    a = parse_args(argv)
    if a.print_wheels:
        print(" ".join(WHEELS))
        return 0
    if a.worker:
        return worker(a.worker)
    start = time.time()
    deadline = start + a.budget_s
    memory = DeviceMemory(a.device == "cuda")  # before this process holds any GPU memory
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("no GPU (torch.cuda.is_available() is False)")
        return 0
    Config, Model = import_official(a.module, a.wheels)
    cfg = model_config(a)
    res = dict(setup=describe(a, cfg))
    setup, cases = res["setup"], make_cases(a.T, a.batch)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.keep or os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        model = build_official(a, Config, Model, cfg)
        setup["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        setup["checkpoint_bytes"] = save_checkpoint(model, cfg, ckpt)
        setup["save_s"] = time.perf_counter() - t0
        print("checkpoint: built in %.0f s, written in %.0f s" % (setup["build_s"], setup["save_s"]), flush=True)
        toks = {"B%d_T%d" % (B, T): tokens(cfg["vocab_size"], B, T) for T, B in cases}
        toks.update({"B1_T%d" % T: tokens(cfg["vocab_size"], 1, T) for T in (a.ref_T, a.grad_T)})
        np.savez(os.path.join(tmp, "tokens.npz"), **toks)

        # the official module eager (a quarter of what is left at most), dclens (all but the time
        # kept for torch.compile), torch.compile (the rest); the JSON is written before compiling
        res["official"] = official_side(
            model, a, cfg, cases, time.time() + 0.25 * (deadline - time.time()), tmp, memory
        )
        if a.device == "cuda":
            torch.cuda.empty_cache()
        keep = min(90, 0.3 * (deadline - time.time())) if a.compile else 0
        res["dclens"] = run_dclens(a, ckpt, cases, tmp, deadline - keep)
        res["accuracy"] = accuracy(res, tmp)
        line = verdict(res, a)
        write(res, a)
        if a.compile:
            enough = deadline - time.time() > 30
            skipped = [dict(T=T, B=B, skipped="budget") for T, B in cases]
            res["compiled"] = dict(cases=compiled_side(model, a, cfg, cases, deadline, memory) if enough else skipped)
    res["elapsed_s"] = time.time() - start
    write(res, a)
    report(res)
    print("\n%s; %.0f s in all" % (line, res["elapsed_s"]))
    return 1 if res["ok"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
