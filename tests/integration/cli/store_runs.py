"""The run the CLI's store caches record on each store (its own module, so that test modules import
it by a name no other directory's helpers share)."""

RECORDED_RUN = "exp_proj/GBS4_N2_in8_out6"
RECORDED_STEPS = [1, 2, 3, 4]
