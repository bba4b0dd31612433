"""A PipelineStage for torch before 2.14, which train_pippy.py imports only there."""

from torch.distributed.pipelining import PipelineStage


class OlderPipelineStage(PipelineStage):
    """A PipelineStage without three bugs of torch before 2.14 (seen on 2.9 and 2.11).

    On 2.9, the first step() or eval() opens the links between stages by sending an int64 scalar
    into a float32 buffer: gloo aborts ("8 vs 4. Received data size doesn't match expected size";
    fixed in 2.10, pytorch PR 165539). An eval() before the first step() (a run resumed at an
    epoch's end) sets the stage up without its backward for good: that step() fails (pytorch
    issue 162822). And on 2.9, shape inference runs the blocks once on zeros in training mode:
    BatchNorm counts that batch (2.14 runs them on meta).
    """

    # All override private methods of those releases' stage.
    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        for op in ops:
            op.tensor = op.tensor.float()  # a send's int64 index; receives are float32
        return ops

    def _prepare_forward_infra(self, num_microbatches, *args, **kwargs):
        # Set up as a first step() does, even in an eval(): these stages train.
        training, self.has_backward = self.has_backward, True
        outputs = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
        self._prepare_backward_infra(num_microbatches)
        self.has_backward = training
        return outputs

    def _shape_inference(self, *args, **kwargs):
        training = self.submod.training
        self.submod.eval()  # the same shapes, and no running statistics updated
        try:
            return super()._shape_inference(*args, **kwargs)
        finally:
            self.submod.train(training)
