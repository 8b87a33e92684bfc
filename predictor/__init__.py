"""TTFT/TPOT prediction from profiling JSON.

from predictor import LatencyPredictor, ProfileError
lp = LatencyPredictor.from_files(ttft_path, tpot_path)
lp.predict_ttft_ms(prefill_tokens, decode_requests, decode_tokens, max_num_batched_tokens)
lp.predict_tpot_ms(decode_requests, decode_tokens)

A leaf package: imports numpy and the standard library, nothing else of the project.
"""

from predictor.interpolation import Grid1D, Grid2D
from predictor.latency import LatencyPredictor
from predictor.profile import ProfileError, TpotProfile, TtftProfile, load_tpot_profile, load_ttft_profile

__all__ = [
    "Grid1D",
    "Grid2D",
    "LatencyPredictor",
    "ProfileError",
    "TpotProfile",
    "TtftProfile",
    "load_tpot_profile",
    "load_ttft_profile",
]
