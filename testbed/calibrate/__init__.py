"""Fitting the cost model to measurements: `testbed profile` / `validate` (profile), the fit of
stage-level tables (fit), the published GPU kernel tables read (gpu_tables), fitted per operator
(kernel_fit) and reported (`testbed calibrate tables`: tables, report, figures), and a synthetic
ground truth for the fits' tests (synthetic). The simulator's hot path imports none of it."""
