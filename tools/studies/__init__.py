"""Learning studies and their plots: staleness against learning (`learning_staleness`) and
its simulator (`simulate_staleness`, docs/async.md), the vision task's learning
(`vision_learning`, docs/vision.md) and a run's curves (`plot_learning`)."""
