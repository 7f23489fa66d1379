"""What comes after training: a trained run opened, evaluated, exported or trained from."""
