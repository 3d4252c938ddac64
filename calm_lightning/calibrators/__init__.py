"""Post-hoc calibrators: fit a temperature from logits (scipy for plain TS, Adam for the
reference-model losses of DACA and Dual-Align). Pure functions; the methods call them."""
