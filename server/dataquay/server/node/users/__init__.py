"""Users of one daemon kept apart: who calls (:mod:`.callers`) and what that user may do (:mod:`.access`)."""
