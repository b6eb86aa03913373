"""Fine-tuning across a node group: training data, and the job that trains."""
