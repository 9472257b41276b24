"""Per-op gradient rules, one module per op family.

Every module registers its rules with :func:`gradbuilder.compiler.registry.register`; the registry
imports all modules of this package on first use.

Rule modules (the op types each registers):

* ``arithmetic``: Add Sub Mul Div Neg Identity Pow Sqrt Reciprocal Exp Log Abs Sum Mean Max Min
  Cast CastLike Where
* ``activations``: Tanh Sigmoid Erf Softplus Softsign Gelu Relu LeakyRelu Elu Selu HardSigmoid
  HardSwish Clip Dropout
* ``math``: Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh Celu Mish ThresholdedRelu
  Shrink PRelu Swish Mod, the piecewise constant Floor Ceil Round Sign Hardmax, Range
* ``cumulative``: CumSum CumProd
* ``reduce``: the Reduce* family
* ``softmax``: Softmax LogSoftmax
* ``losses``: NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss
* ``linalg``: MatMul Gemm Einsum Trilu Det
* ``shape``: Reshape Flatten Transpose Squeeze Unsqueeze Expand Concat Split Tile Pad
  ReverseSequence
* ``indexing``: Slice Gather GatherND GatherElements
* ``scatter``: ScatterElements ScatterND TensorScatter
* ``selection``: TopK Compress OneHot Unique
* ``conv``: Conv ConvTranspose DeformConv CausalConvWithState
* ``pooling``: AveragePool MaxPool GlobalAveragePool GlobalMaxPool MaxUnpool LpPool GlobalLpPool
* ``roi``: RoiAlign MaxRoiPool
* ``resize``: Resize
* ``spatial``: GridSample AffineGrid DepthToSpace SpaceToDepth Col2Im CenterCropPad
* ``normalization``: BatchNormalization LayerNormalization InstanceNormalization
  GroupNormalization
* ``misc_norm``: LpNormalization MeanVarianceNormalization LRN RMSNormalization
* ``attention``: Attention RotaryEmbedding, FlexAttention (ai.onnx.preview)
* ``recurrent``: RNN GRU LSTM
* ``signal``: DFT STFT
* ``quantize``: DequantizeLinear
* ``control_flow``: If Loop Scan
* ``optional``: Optional OptionalGetElement
* ``misc_ops``: ops whose float inputs get no or a zero gradient: MelWeightMatrix EyeLike, and
  the random draws (stop-gradient edges)
* ``contrib``: the com.microsoft fusions (Gelu FastGelu BiasGelu QuickGelu FusedMatMul
  SkipLayerNormalization SkipSimplifiedLayerNormalization SimplifiedLayerNormalization BiasAdd
  BiasSoftmax)
* ``contrib_attention``: the com.microsoft attention ops of onnxruntime-genai's model builder and
  onnxruntime's transformer optimizer (GroupQueryAttention RotaryEmbedding MultiHeadAttention)
* ``ml``: the ai.onnx.ml ops with a float path
* ``training_ops``: Adagrad Momentum Adam (ai.onnx.preview.training)

Helper modules (they register no rule; rules import them):

* ``helpers``: value helpers: string attributes, optional outputs, whether an optional input
  needs a gradient, ranks, constants in another value's dtype, the compute dtypes, keep /
  safe_div / sums, the zero gradient of piecewise constant ops
* ``sizes``: size arithmetic (static ints folded in Python, run-time sizes as int64 tensors)
* ``windows``: the geometry of sliding windows (Conv, the pools, RoiAlign)
* ``norm_stats``: normalization statistics and the backward through them

A rule is ``@register(op_type) def rule(n, dys, needs, e)``: ``n`` the forward node, ``dys`` the
gradients of its outputs (None where none flows), ``needs[i]`` whether input i needs a gradient
(``helpers.wants(needs, i)`` for an optional input), ``e`` the emitter
(:class:`gradbuilder.compiler.emitter.Emitter`); it returns one gradient or None per input.
"""
