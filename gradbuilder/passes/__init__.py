"""Graph transforms, one module each; every pass is a function Model -> Model."""
