"""Input pipelines: samplers that resume exactly, DataLoader set-up, image decoding and batch
augmentation on the device, dataset readers and staging (README "Layout")."""
