"""Top-1 / top-5 over a loader, every sample counted once across processes."""
import torch
from timm.utils import accuracy


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    model.eval()
    correct1 = correct5 = count = 0
    for batch in loader:
        images, targets = batch[0], batch[1]
        if images is None:
            continue
        with accelerator.autocast():
            logits = model(images)
        logits, targets = accelerator.gather_for_metrics((logits.float(), targets))
        top1, top5 = accuracy(logits, targets, topk=(1, min(5, logits.shape[-1])))
        n = targets.shape[0]
        correct1 += top1.item() * n / 100.0
        correct5 += top5.item() * n / 100.0
        count += n
    return dict(top1=100.0 * correct1 / max(count, 1), top5=100.0 * correct5 / max(count, 1), count=count)
