"""TileLang kernels, one module per op (each a `@tilelang.jit` factory, a torch check and a main())."""
