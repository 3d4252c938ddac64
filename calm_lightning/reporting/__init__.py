"""Sweep reports in three steps: `collect` reads run directories into runs with their swept
hyper-parameters, `selection` averages seeds and applies the paper's selection rule, and `render`
writes the paper-style tables, CSVs and the reliability-diagram grid."""
