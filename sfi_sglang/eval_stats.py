"""The plain math of `sfi-sglang eval quality` (sfi_sglang.eval): the bytes each row reads
per step, the 95% intervals, and the summary of a result's rows.

Intervals (the result's "summary", the markdown tables, the plot's error bars), 95%:
  - top-1 agreement and mean KL: a Student t-interval over the per-text means (mean +-
    t(0.975, n-1) x sd / sqrt(n), n = texts of that method, retention and context; a
    text's steps are not independent, so the text is the unit). With few texts it is
    wide (t = 12.7 at n = 2, 2.36 at n = 8), which is the honest answer; a percentile
    bootstrap over 2-8 texts would be too narrow. Clipped to [0, 1] for agreement and to
    >= 0 for KL; none for a single text.
  - passkey and retrieval found/total per (method, context, depth): the Wilson score interval.
"""

from __future__ import annotations

import math

from sfi_sglang.method.config import SFIConfig


# ---------------------------------------------------------------- bytes read per step
def read_fraction(row: dict) -> float:
    """K/V bytes a sparse layer reads per scored decode step, as a fraction of a dense
    step's, from a teacher-forced row (context n, its options, steps and slow steps):
      streaming, snapkv  S + W + K
      quest              S + W + K + n / page  (per-page min/max keys: one token's K and V
                         per page)
      sfi                fast steps S + K + W + d (the window grows d tokens after each
                         selection; slow steps spread evenly, so d averages steps / (2
                         (slow + 1))), slow steps n; with the top-up also P pages and the
                         n / page summaries on fast steps (at 1/topup_every of the layers,
                         counted as an average over them)
    The dense layers read n in every method alike; the slow step's score writes (3% of
    its reads) are left out."""
    n, steps = row["context"], max(row["steps"], 1)
    if row.get("enabled") is False:
        return 1.0
    s, w, k = row["sinks"], row["window"], row["budget"]
    method, page = row.get("method"), SFIConfig().page_size
    if method in ("streaming", "snapkv"):
        return (s + w + k) / n
    if method == "quest":
        return (s + w + k // page * page + n / page) / n
    slow = min(row.get("slow_steps", 0), steps)
    fast = s + k + w + steps / (2 * (slow + 1))
    if row.get("topup_pages"):
        fast += row["topup_pages"] * page + n / page / row.get("topup_every", 1)
    return ((steps - slow) * fast + slow * n) / (steps * n)


# ---------------------------------------------------------------- intervals (plain math)
_T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423]
Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom (a table to 30, then
    the Cornish-Fisher expansion, within 1e-4)."""
    if df < 1:
        raise ValueError("df >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci(values: list[float], lo: float = -math.inf, hi: float = math.inf):
    """(mean, low, high): the 95% t-interval of the mean, clipped to [lo, hi]; low and high
    are None for fewer than two values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return mean, max(lo, mean - half), min(hi, mean + half)


def wilson(found: int, total: int, z: float = Z975) -> tuple[float, float]:
    """The Wilson score interval (95%) of a proportion found/total."""
    p = found / total
    den = 1 + z * z / total
    mid = (p + z * z / (2 * total)) / den
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


INTERVALS = {"teacher_forced": "95% Student t-interval over per-text means (text = unit)",
             "passkey": "95% Wilson score interval", "retrieval": "95% Wilson score interval"}


def summary(rows: list[dict]) -> dict:
    """Per (method, retention, context): texts, steps, top-1 agreement and mean KL with
    their intervals; per (method, context, depth): passkey found/total with its interval."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["kind"] == "teacher_forced":
            groups.setdefault((r["method"], r["retention"], r["context"]), []).append(r)
    tf = []
    for (m, ret, ctx), rs in sorted(groups.items(), key=lambda x: (x[0][2], x[0][1], x[0][0])):
        a, a_lo, a_hi = mean_ci([r["top1_agreement"] for r in rs], 0.0, 1.0)
        k, k_lo, k_hi = mean_ci([r["mean_kl"] for r in rs], 0.0)
        steps = sum(r["steps"] for r in rs)
        reads = [r["read"] for r in rs if "read" in r]
        tf.append({"method": m, "retention": ret, "context": ctx, "texts": len(rs),
                   "read": sum(reads) / len(reads) if reads else None,
                   "sources": sorted({r["source"] for r in rs}), "steps": steps,
                   # slow decode steps per scored step (each run decodes its scored steps)
                   "slow_rate": sum(r.get("slow_steps", 0) for r in rs) / max(steps, 1),
                   "top1_agreement": a, "top1_ci": [a_lo, a_hi] if a_lo is not None else None,
                   "mean_kl": k, "kl_ci": [k_lo, k_hi] if k_lo is not None else None})
    return {"intervals": INTERVALS, "teacher_forced": tf, "passkey": _found(rows, "passkey"),
            "retrieval": _found(rows, "retrieval")}


def _found(rows: list[dict], kind: str) -> list[dict]:
    """found/total with its Wilson interval per (method, context, depth) of one kind of rows."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["kind"] == kind:
            groups.setdefault((r["method"], r["context"], r.get("depth")), []).append(r)
    out = []
    for (m, ctx, d), rs in sorted(groups.items(), key=lambda x: (x[0][1], x[0][0], x[0][2] or 0)):
        found = sum(bool(r["found"]) for r in rs)
        out.append({"method": m, "context": ctx, "depth": d, "found": found, "total": len(rs),
                    "ci": list(wilson(found, len(rs)))})
    return out
