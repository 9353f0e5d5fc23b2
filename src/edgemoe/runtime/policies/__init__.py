"""Runtime policies: exact, drop and slimcaching (`baselines`), ordermoe (`ordermoe`, its compiled kernel
`ordermoe_kernel`) and the hindsight oracle (`oracle`)."""
