"""Wireless link rates in SlimCaching's form (ALGORITHMS.md §2.3): r = B log2(1 + p G / (N0 B)).

Powers in dBm, gains in dB, noise power spectral density in dBm/Hz; rates come out in bytes/s.
"""

from __future__ import annotations

import numpy as np


def dbm_to_watt(dbm: np.ndarray | float) -> np.ndarray:
    """[...] dBm -> watts."""
    return 10.0 ** ((np.asarray(dbm, dtype=float) - 30.0) / 10.0)


def path_loss_db(distance_m: np.ndarray | float) -> np.ndarray:
    """[...] urban macro path loss 128.1 + 37.6 log10(d / km) dB (3GPP TR 36.814 model, the one the
    edge-caching literature uses; ALGORITHMS.md §2.6). Distances under 1 m are treated as 1 m."""
    d_km = np.maximum(np.asarray(distance_m, dtype=float), 1.0) / 1000.0
    return 128.1 + 37.6 * np.log10(d_km)


def shannon_rate_Bps(
    bandwidth_hz: np.ndarray | float,
    tx_power_dbm: np.ndarray | float,
    gain_db: np.ndarray | float,
    noise_dbm_per_hz: np.ndarray | float = -174.0,
) -> np.ndarray:
    """[...] bytes/s of a link: B log2(1 + p G / (N0 B)) / 8, all arguments broadcast together.

    gain_db is the channel gain (negative: -path_loss_db(d)); -174 dBm/Hz is thermal noise at 290 K.
    """
    bandwidth_hz = np.asarray(bandwidth_hz, dtype=float)
    signal_w = dbm_to_watt(tx_power_dbm) * 10.0 ** (np.asarray(gain_db, dtype=float) / 10.0)
    noise_w = dbm_to_watt(noise_dbm_per_hz) * bandwidth_hz
    return bandwidth_hz * np.log2(1.0 + signal_w / noise_w) / 8.0
