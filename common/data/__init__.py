"""Input pipelines: resumable samplers, DataLoader set-up, image decoding and augmentation, dataset readers."""
