"""roundpipe.timer.ModelTimer: the original's switch for timing logs.

The engine measures every layer's forward, recompute and backward times on
the devices itself (with device timing marks, smoothed, the first sample
dropped) and plans from them. ``ModelTimer.VERBOSE = True`` makes the
RoundPipes made afterwards log them, with the plan they lead to, as
``RoundPipe(..., verbose=True)`` does. SMOOTH_RATE and BACKWARD_MULTIPLIER
are the original's attributes; the engine's smoothing rate is 0.9, and it
measures backward times instead of multiplying forward ones."""


class ModelTimer:
    VERBOSE = False
    SMOOTH_RATE = 0.9
    BACKWARD_MULTIPLIER = 2.0
