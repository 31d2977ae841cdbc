"""Service gain (Tempo, §3.1): token-weighted useful work, discounted when late.

A request is worth ``w_in · prompt tokens + w_out · output tokens`` (1 : 2, as input and output
are priced), and a late request earns that times the divisive decay

    f(SLO, m) = min(1, (SLO / m) ** alpha)        (alpha = 1; alpha -> inf is binary goodput)

Finishing early earns nothing extra, finishing late still earns something - unlike attainment,
which counts a request 1 s late the same as one never served. The paper's Eq. 4 has a sign error
(the digest notes it); this is the decay as Eqs. 1-3 define it, and which deadline discounts what:

* end-to-end deadline only (throughput requests, Eq. 2): the whole gain by f(SLO_e2e, e2e);
* TTFT deadline only (streaming, Eq. 3): the prompt part by f(SLO_ttft, TTFT); the output part by
  the Andes-style delivery timeline when a time-between-tokens SLO is given - token k is due at
  SLO_ttft + (k - 1) · SLO_tbt after arrival, and one emitted later earns f(due, emitted) - else
  undiscounted. Token emission times are taken as evenly spaced between the first and the last
  token (what the simulator knows), so the output part is the mean of f over that timeline;
* both deadlines: the prompt part by the TTFT decay, the output part by the end-to-end one.

A request never served earns 0.
"""

from __future__ import annotations

import math

import numpy as np

W_IN = 1.0
W_OUT = 2.0
ALPHA = 1.0


def decay(slo_s: float, measured_s: float, alpha: float = ALPHA) -> float:
    """f(SLO, m) = min(1, (SLO / m) ** alpha): 1 when on time, falling as lateness grows."""
    if slo_s <= 0 or alpha <= 0:
        raise ValueError("the SLO and alpha must be positive")
    if measured_s <= slo_s:
        return 1.0
    if math.isinf(alpha):
        return 0.0
    return float((slo_s / measured_s) ** alpha)


def service_gain(
    prompt_tokens: int,
    output_tokens: int,
    *,
    ttft_s: float | None,
    e2e_s: float | None,
    e2e_slo_s: float | None = None,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
    w_in: float = W_IN,
    w_out: float = W_OUT,
    alpha: float = ALPHA,
) -> float:
    """The effective service gain of one request (module docstring). ``ttft_s``/``e2e_s``:
    seconds from arrival to the first / last token, None if it never got there."""
    if prompt_tokens < 0 or output_tokens < 0:
        raise ValueError("token counts must be >= 0")
    if e2e_s is None or ttft_s is None:
        return 0.0
    base_in, base_out = w_in * prompt_tokens, w_out * output_tokens
    if ttft_slo_s is None:
        if e2e_slo_s is None:  # best effort: whatever is served is worth its tokens
            return base_in + base_out
        return (base_in + base_out) * decay(e2e_slo_s, e2e_s, alpha)
    gain_in = base_in * decay(ttft_slo_s, ttft_s, alpha)
    if e2e_slo_s is not None:
        return gain_in + base_out * decay(e2e_slo_s, e2e_s, alpha)
    if tbt_slo_s is None or output_tokens <= 1:
        return gain_in + base_out
    k = np.arange(output_tokens, dtype=np.float64)
    emitted = ttft_s + k * (e2e_s - ttft_s) / (output_tokens - 1)
    due = ttft_slo_s + k * tbt_slo_s
    late = emitted > due
    factors = np.ones(output_tokens)
    if math.isinf(alpha):
        factors[late] = 0.0
    else:
        factors[late] = (due[late] / emitted[late]) ** alpha
    return gain_in + w_out * float(factors.sum())
