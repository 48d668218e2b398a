"""`flashrec bench`: the synthetic wave benchmark (`run`), `Engine.generate` on a checkpoint
(`e2e`), a running server under load (`load`), and the roofline model they share (`roofline`).

Nothing is imported here: the load generator's client processes import `load` alone, without
torch."""
